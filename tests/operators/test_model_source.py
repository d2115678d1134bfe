"""trainforge.model_source: every form of ``model.pretrained`` resolved to a folder holding
config.json, with no network: a local folder, an ``s3://`` prefix (moto server), an ``hf://``
model from a Hugging Face cache the test fills (``HF_HUB_OFFLINE=1``) and a registered model
(the session's MLflow server). Each unusable source is a PretrainedSourceError naming it."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest

from trainforge.model_source import PretrainedSourceError, ResolvedModel, resolve_pretrained

COMMIT = "a" * 8 + "0123456789abcdef0123456789abcdef"
OTHER_COMMIT = "b" * 40
FILES = {"config.json": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
         "tokenizer.json": {"version": "1.0"}, "generation_config.json": {"eos_token_id": [1, 2]}}


def _folder(path: Path, files: dict = FILES) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (path / name).write_text(json.dumps(content))
    return path


# -- local folders ------------------------------------------------------------------------------
def test_an_absolute_folder_resolves_as_it_is(tmp_path):
    folder = _folder(tmp_path / "llama")
    resolved = resolve_pretrained(str(folder), engine="local", home=tmp_path / "home")
    assert resolved == ResolvedModel(str(folder), str(folder), None)
    assert resolved.job_section() == {"folder": str(folder), "source": str(folder),
                                      "revision": None}


def test_a_relative_folder_resolves_against_trainforge_home(tmp_path):
    folder = _folder(tmp_path / "models" / "qwen3")
    resolved = resolve_pretrained("models/qwen3", engine="local", home=tmp_path)
    assert resolved.folder == str(folder) and resolved.source == "models/qwen3"


def test_a_folder_without_config_json_is_refused_naming_the_file(tmp_path):
    folder = _folder(tmp_path / "weights", {"tokenizer.json": {}})
    with pytest.raises(PretrainedSourceError) as info:
        resolve_pretrained("weights", engine="local", home=tmp_path)
    assert str(info.value).startswith("model.pretrained weights: ")
    assert f"{folder / 'config.json'} does not exist (weights resolved to {folder})" in str(
        info.value)


def test_a_bare_hub_name_is_refused_with_the_hf_uri_to_write(tmp_path):
    with pytest.raises(PretrainedSourceError, match=r"for the Hugging Face Hub's "
                       r"HuggingFaceTB/SmolLM2-135M, write hf://HuggingFaceTB/SmolLM2-135M$"):
        resolve_pretrained("HuggingFaceTB/SmolLM2-135M", engine="local", home=tmp_path)
    (tmp_path / "models").mkdir()  # a folder of the user's: no Hub hint, only the missing file
    with pytest.raises(PretrainedSourceError) as info:
        resolve_pretrained("models/tiny", engine="local", home=tmp_path)
    assert "hf://" not in str(info.value)


def test_a_local_folder_is_refused_for_an_engine_without_this_disk(tmp_path):
    folder = _folder(tmp_path / "llama")
    with pytest.raises(PretrainedSourceError, match="the kubernetes engine's ranks cannot read"):
        resolve_pretrained(str(folder), engine="kubernetes", home=tmp_path)


# -- s3:// --------------------------------------------------------------------------------------
@pytest.mark.integration
def test_an_s3_prefix_is_checked_for_config_json(s3_server, monkeypatch, tmp_path):
    from trainforge.storage import s3

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    bucket = f"weights-{uuid.uuid4().hex[:10]}"
    s3.client().create_bucket(Bucket=bucket)
    for name, content in FILES.items():
        s3.put_bytes(f"s3://{bucket}/llama/{name}", json.dumps(content).encode())

    resolved = resolve_pretrained(f"s3://{bucket}/llama/", engine="kubernetes", home=tmp_path)
    assert resolved.job_section() == {"folder": f"s3://{bucket}/llama",
                                      "source": f"s3://{bucket}/llama/", "revision": None}
    # an Airflow connection's client is used when given
    own = s3.make_client(s3_server)
    assert resolve_pretrained(f"s3://{bucket}/llama", engine="local", home=tmp_path,
                              s3_client=own).folder == f"s3://{bucket}/llama"
    with pytest.raises(PretrainedSourceError) as info:
        resolve_pretrained(f"s3://{bucket}/nothing/", engine="local", home=tmp_path)
    assert f"s3://{bucket}/nothing/config.json does not exist" in str(info.value)


# -- hf:// from a filled cache, offline ---------------------------------------------------------
def _hub_cache(hf_home: Path, repo: str, commit: str, files: dict = FILES,
               refs: tuple[str, ...] = ("main",)) -> Path:
    """The Hugging Face cache layout huggingface_hub writes: blobs by hash, a snapshot folder
    per commit of links to them, refs naming the commit."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name, content in files.items():
        data = json.dumps(content).encode()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """HF_HOME in tmp_path, offline: nothing can come from the network."""
    hf_home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return hf_home


def test_an_hf_model_resolves_to_its_cached_snapshot_and_commit(hub, tmp_path):
    snapshot = _hub_cache(hub, "org/tiny-llama", COMMIT)
    resolved = resolve_pretrained("hf://org/tiny-llama", engine="local", home=tmp_path)
    assert resolved == ResolvedModel("hf://org/tiny-llama", str(snapshot), COMMIT)
    assert json.loads((Path(resolved.folder) / "config.json").read_text())["model_type"] == "llama"


def test_an_hf_model_at_a_commit_or_a_branch(hub, tmp_path):
    _hub_cache(hub, "org/tiny-llama", COMMIT)
    snapshot = _hub_cache(hub, "org/tiny-llama", OTHER_COMMIT, refs=("v2",))
    at_commit = resolve_pretrained(f"hf://org/tiny-llama@{OTHER_COMMIT}", engine="local",
                                   home=tmp_path)
    assert (at_commit.folder, at_commit.revision) == (str(snapshot), OTHER_COMMIT)
    at_branch = resolve_pretrained("hf://org/tiny-llama@v2", engine="local", home=tmp_path)
    assert (at_branch.folder, at_branch.revision) == (str(snapshot), OTHER_COMMIT)


@pytest.mark.parametrize("uri,named", [
    ("hf://org/uncached", "org/uncached@main is not in the Hugging Face cache"),
    ("hf://org/tiny-llama@v9", "org/tiny-llama@v9 is not in the Hugging Face cache"),
    (f"hf://org/tiny-llama@{OTHER_COMMIT}",
     f"org/tiny-llama@{OTHER_COMMIT} is not in the Hugging Face cache"),
])
def test_a_model_not_in_the_offline_cache_is_refused_naming_it(hub, tmp_path, uri, named):
    _hub_cache(hub, "org/tiny-llama", COMMIT)
    with pytest.raises(PretrainedSourceError) as info:
        resolve_pretrained(uri, engine="local", home=tmp_path)
    message = str(info.value)
    assert message.startswith(f"model.pretrained {uri}: {named} {hub / 'hub'}"), message
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in message and "hf download" in message


def test_a_cached_snapshot_without_config_json_is_refused(hub, tmp_path):
    snapshot = _hub_cache(hub, "org/no-config", COMMIT, {"tokenizer.json": {}})
    with pytest.raises(PretrainedSourceError) as info:
        resolve_pretrained("hf://org/no-config", engine="local", home=tmp_path)
    assert f"{snapshot / 'config.json'} does not exist" in str(info.value)


def test_an_hf_model_is_refused_for_an_engine_without_this_disk(hub, tmp_path):
    _hub_cache(hub, "org/tiny-llama", COMMIT)
    with pytest.raises(PretrainedSourceError, match="copy the folder to S3"):
        resolve_pretrained("hf://org/tiny-llama", engine="kubernetes", home=tmp_path)


def test_prepare_datas_resolution_is_reused_by_the_train_task(hub, tmp_path):
    from trainforge.model_source import pretrained_section

    snapshot = _hub_cache(hub, "org/tiny-llama", COMMIT)
    earlier = {"folder": "/elsewhere/snapshot", "source": "hf://org/tiny-llama",
               "revision": OTHER_COMMIT}
    kwargs = {"engine": "local", "home": tmp_path}
    assert pretrained_section("hf://org/tiny-llama", {"pretrained": earlier}, **kwargs) == earlier
    assert pretrained_section("hf://org/tiny-llama", {"dataset_dir": "/d"}, **kwargs) == {
        "folder": str(snapshot), "source": "hf://org/tiny-llama", "revision": COMMIT}


# -- models:/ -----------------------------------------------------------------------------------
@pytest.mark.integration
def test_a_registered_model_resolves_to_its_folder_once(mlflow_server, tiny_hf_model_dir,
                                                         tmp_path):
    from trainforge.hooks.mlflow import MlflowHook

    hook = MlflowHook(tracking_uri=mlflow_server)
    suffix = uuid.uuid4().hex[:8]
    run_id = hook.get_or_create_run(f"pretrained-{suffix}", "tiny.dag", f"manual__{suffix}")
    name = f"tiny-pretrained-{suffix}"
    version = hook.register_model_version(run_id, tiny_hf_model_dir, name, "ckpt-pretrained",
                                          aliases=["champion"])["version"]

    resolved = resolve_pretrained(f"models:/{name}@champion", engine="local", home=tmp_path,
                                  mlflow_hook=hook)
    assert resolved.revision == f"models:/{name}/{version}"
    assert resolved.folder == str((tmp_path / "models" / name / str(version)).resolve())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in
                                                    Path(resolved.folder).iterdir()}
    again = resolve_pretrained(f"models:/{name}/{version}", engine="local", home=tmp_path,
                               mlflow_hook=hook)
    assert again.folder == resolved.folder
    with pytest.raises(PretrainedSourceError, match="the registry has no such version"):
        resolve_pretrained(f"models:/{name}@nosuch", engine="local", home=tmp_path,
                           mlflow_hook=hook)
    with pytest.raises(PretrainedSourceError, match="reads initial weights from S3"):
        resolve_pretrained(f"models:/{name}/{version}", engine="kubernetes", home=tmp_path,
                           mlflow_hook=hook)


# -- the Hub token ------------------------------------------------------------------------------
def test_the_hub_token_comes_from_an_airflow_connections_password(monkeypatch):
    from trainforge.model_source import connection_token

    monkeypatch.setenv("AIRFLOW_CONN_HF_TEST", json.dumps({"conn_type": "generic",
                                                           "password": "hf_secret"}))
    assert connection_token("hf_test") == "hf_secret"
    monkeypatch.setenv("AIRFLOW_CONN_HF_EMPTY", json.dumps({"conn_type": "generic"}))
    with pytest.raises(PretrainedSourceError, match="hf_empty: the Airflow connection has no "
                                                    "password"):
        connection_token("hf_empty")
