"""Open weights in the trainer: a Hugging Face folder of each family loads with nothing lost, trains
on 2 ranks (DDP and FSDP2), validates and exports as the same model with its own tokenizer.

Each family is a tiny random-weight model the session saves itself (tests/hf_models.py: bf16, at
least 3 shards with an index, a local tokenizer with a chat template). The reference is plain
transformers loading the same folder: the trainer's loss on a batch must equal it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.hf_models import FAMILIES, reference_loss, sample_ids
from tests.trainer.conftest import build_dataset
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer import loss as losses
from trainforge.trainer import pretrained
from trainforge.trainer.config import parse_job_config
from trainforge.trainer.data import open_dataset
from trainforge.trainer.errors import ConfigError
from trainforge.trainer.export import EXPORT_INFO, export_checkpoint
from trainforge.trainer.model import decoder_layers, job_model, lm_loss
from trainforge.trainer.validate import validate_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _eos_token(folder: Path) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).eos_token


@pytest.fixture(scope="module")
def family_data(hf_model, tmp_path_factory):
    """``family_data(family) -> (model folder, dataset folder encoded with its tokenizer)``."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            folder = hf_model(family)
            data = build_dataset(tmp_path_factory.mktemp(f"data-{family}") / "ds", n_train=24, n_val=4,
                                   tokenizer_file=folder / "tokenizer.json", eos_token=_eos_token(folder))
            made[family] = (folder, data)
        return made[family]

    return get


def pretrained_job(tools, folder: Path, dataset_dir: Path, checkpoints: Path, **sections) -> dict:
    """A job config that fine-tunes the model in ``folder`` (the contract's pretrained form)."""
    job = tools.make_job(dataset_dir, checkpoints, **{k: v for k, v in sections.items() if k != "framework"})
    job["framework"] = dict(sections.get("framework", ()))
    job["model"] = {"family": "pretrained", "dropout": None}
    job["pretrained"] = {"folder": str(folder), "source": str(folder), "revision": None}
    return job


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loaded_model_has_the_loss_of_plain_transformers(family, family_data, tools, tmp_path):
    folder, data = family_data(family)
    cfg = parse_job_config(pretrained_job(tools, folder, data, tmp_path / "ck"))
    ids = sample_ids(folder, batch=2, length=33)
    with job_model(cfg, open_dataset(data), weights=True) as model:
        model.eval()
        with torch.no_grad():
            ours = lm_loss(model, ids[:, :-1], ids[:, 1:]).item()
            chunked = losses.lm_loss(model, ids[:, :-1], ids[:, 1:], chunk_tokens=16).item()
    reference = reference_loss(folder, ids)
    assert ours == pytest.approx(reference, rel=1e-5)
    assert chunked == pytest.approx(reference, rel=1e-5)  # the trainer's chunked loss path too
    source = json.loads((folder / "config.json").read_text())
    assert len(decoder_layers(model)) == source["num_hidden_layers"]
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.dtype == torch.float32 or not tensor.is_floating_point(), name  # fp32 master weights
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head.data_ptr() == embed.data_ptr()) == bool(source.get("tie_word_embeddings"))
    rope = (source.get("rope_parameters") or source.get("rope_scaling") or {}).get("rope_type", "default")
    assert model.model.rotary_emb.rope_type == rope
    for key in ("sliding_window", "final_logit_softcapping", "attn_logit_softcapping"):
        assert getattr(model.config, key, None) == source.get(key)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_trains_on_two_ranks_validates_and_exports(family, family_data, tools, tmp_path):
    """DDP (each rank loads the whole model) and FSDP2 (each rank reads its rows after sharding)
    reach the same loss after 10 steps from the same shards; the DDP checkpoint validates and
    exports as the base's architecture."""
    folder, data = family_data(family)
    losses = {}
    for parallelism in ("ddp", "fsdp"):
        run = tmp_path / parallelism
        run.mkdir()
        job = pretrained_job(tools, folder, data, run / "ck",
                             optim={"max_steps": 10, "warmup_steps": 2, "learning_rate": 1e-3},
                             framework=[("parallelism", parallelism), ("compile", False)],
                             checkpoint={"interval_steps": 10})
        proc = tools.run_trainer(tools.write_job(run / "job.json", job), run / "result.json", nproc=2)
        assert proc.returncode == 0, proc.stdout[-4000:]
        result = json.loads((run / "result.json").read_text())
        assert result["status"] == "success" and result["final_step"] == 10
        assert "val/loss_at_start" in proc.stdout  # the base model evaluated before step 1
        assert ("each rank read only its rows" in proc.stdout) == (parallelism == "fsdp")
        losses[parallelism] = result["final_train_loss"]
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-4)
    step_dir = tmp_path / "ddp" / "ck" / ckpt.step_dir_name(10)
    report = validate_checkpoint(step_dir, data)
    assert report["ok"], report["checks"]
    out = export_checkpoint(step_dir, data, tmp_path / "hf")
    _check_export(out, folder, step_dir)


def _check_export(out: Path, base: Path, step_dir: Path) -> None:
    """The export is the base's architecture with the trained weights and the base's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == json.loads((base / "config.json").read_text())["architectures"][0]
    trained = safetensors.torch.load_file(step_dir / ckpt.WEIGHTS)
    state = model.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert tokenizer.chat_template  # the base's chat template travels with the model
    assert GenerationConfig.from_pretrained(out).eos_token_id == GenerationConfig.from_pretrained(base).eos_token_id
    info = json.loads((out / EXPORT_INFO).read_text())
    assert info["base_model"]["source"] == str(base) and info["base_model"]["license"] == "apache-2.0"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Who wrote Hamlet?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


# Bad input: each a ConfigError (exit 78, never retried) naming the file and the tensor or field.

def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def _load(folder: Path, tools, data: Path, tmp_path: Path) -> None:
    cfg = parse_job_config(pretrained_job(tools, folder, data, tmp_path / "ck"))
    with job_model(cfg, open_dataset(data), weights=True):
        pass


def _edit_json(path: Path, **changes) -> None:
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


def test_bad_folders_are_refused_naming_file_and_tensor(family_data, tools, tmp_path):
    folder, data = family_data("llama")
    index = json.loads((folder / pretrained.INDEX).read_text())["weight_map"]
    a_tensor, its_shard = sorted(index.items())[0]

    broken = _copy(folder, tmp_path / "no-config")
    (broken / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"no-config: no config\.json"):
        _load(broken, tools, data, tmp_path)

    broken = _copy(folder, tmp_path / "no-shard")
    (broken / its_shard).unlink()
    with pytest.raises(ConfigError, match=f"names shard {its_shard}, which is missing"):
        _load(broken, tools, data, tmp_path)

    broken = _copy(folder, tmp_path / "ghost-tensor")
    _edit_json(broken / pretrained.INDEX, weight_map={**index, "model.layers.0.ghost.weight": its_shard})
    with pytest.raises(ConfigError, match=rf"tensor model\.layers\.0\.ghost\.weight is indexed in {its_shard}"):
        _load(broken, tools, data, tmp_path)

    broken = _copy(folder, tmp_path / "wrong-shape")
    _edit_json(broken / "config.json", intermediate_size=96)
    with pytest.raises(ConfigError, match=r"tensor model\.layers\.\d+\.mlp\.\w+_proj\.weight has shape .* "
                                          r"but config\.json gives .*\(config\.json's intermediate_size: 96\)$"):
        _load(broken, tools, data, tmp_path)

    broken = _copy(folder, tmp_path / "unknown-arch")
    _edit_json(broken / "config.json", model_type="nosuchmodel", architectures=["NoSuchForCausalLM"])
    with pytest.raises(ConfigError, match=r"config\.json: model_type 'nosuchmodel' is not an architecture"):
        _load(broken, tools, data, tmp_path)

    broken = _copy(folder, tmp_path / "unknown-class")
    _edit_json(broken / "config.json", architectures=["FooForCausalLM"])
    with pytest.raises(ConfigError, match=r"config\.json: architectures names FooForCausalLM, a class this "
                       r"transformers [\d.]+ does not have; expected LlamaForCausalLM for model_type 'llama'"):
        _load(broken, tools, data, tmp_path)

    broken = _copy(folder, tmp_path / "encoder")
    (broken / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 640, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}))
    with pytest.raises(ConfigError, match=r"BertForMaskedLM \(model_type 'bert'\) is not a decoder-only causal LM"):
        _load(broken, tools, data, tmp_path)


def test_a_dataset_of_another_tokenizer_is_refused(family_data, tools, tmp_path):
    folder, _ = family_data("qwen3")
    _, other = family_data("llama")
    with pytest.raises(ConfigError, match="the dataset was encoded with another tokenizer"):
        _load(folder, tools, other, tmp_path)


def test_the_trainer_fails_permanently_on_a_missing_shard(family_data, tools, tmp_path):
    folder, data = family_data("mistral")
    broken = _copy(folder, tmp_path / "model")
    shard = sorted(json.loads((broken / pretrained.INDEX).read_text())["weight_map"].values())[-1]
    (broken / shard).unlink()
    job = pretrained_job(tools, broken, data, tmp_path / "ck", optim={"max_steps": 2, "warmup_steps": 0})
    proc = tools.run_trainer(tools.write_job(tmp_path / "job.json", job), tmp_path / "result.json")
    assert proc.returncode == 78, proc.stdout[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "bad_config"
    assert f"names shard {shard}, which is missing" in result["message"]


@pytest.mark.integration
def test_a_folder_on_s3_loads_as_the_same_model(family_data, tools, tmp_path, s3_server, monkeypatch):
    """An ``s3://`` pretrained folder (moto's server on loopback) is read through the storage layer
    and gives the loss of the local folder."""
    import uuid

    from trainforge.storage import s3

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    folder, data = family_data("gemma2")
    bucket = f"weights-{uuid.uuid4().hex[:10]}"
    s3.client().create_bucket(Bucket=bucket)
    for path in folder.iterdir():
        s3.client().upload_file(str(path), bucket, f"gemma2/{path.name}")
    job = pretrained_job(tools, folder, data, tmp_path / "ck")
    job["pretrained"]["folder"] = f"s3://{bucket}/gemma2"
    ids = sample_ids(folder, batch=2, length=33)
    with job_model(parse_job_config(job), open_dataset(data), weights=True) as model:
        model.eval()
        with torch.no_grad():
            loss = lm_loss(model, ids[:, :-1], ids[:, 1:]).item()
    assert loss == pytest.approx(reference_loss(folder, ids), rel=1e-5)
    job["pretrained"]["folder"] = f"s3://{bucket}/nothing-here"
    with pytest.raises(ConfigError, match=rf"s3://{bucket}/nothing-here: no config\.json"):
        with job_model(parse_job_config(job), open_dataset(data), weights=True):
            pass


def test_an_hf_model_from_the_offline_cache_loads_as_the_same_model(family_data, tools, tmp_path,
                                                                   monkeypatch):
    """An ``hf://`` source, offline (``HF_HUB_OFFLINE=1``), from a Hugging Face cache this test
    fills the way huggingface_hub does (blobs, a snapshot of links, a ref): the source resolves
    to the snapshot at the ref's commit, and the trainer's loss there equals the local folder's."""
    import hashlib

    from trainforge.model_source import resolve_pretrained

    folder, data = family_data("qwen3")
    commit = "c0ffee" * 6 + "c0ff"
    repo = tmp_path / "hf" / "hub" / "models--org--tiny-qwen3"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)

    resolved = resolve_pretrained("hf://org/tiny-qwen3", engine="local", home=tmp_path)
    assert (resolved.folder, resolved.revision) == (str(snapshot), commit)
    job = pretrained_job(tools, folder, data, tmp_path / "ck")
    job["pretrained"] = resolved.job_section()
    ids = sample_ids(folder, batch=2, length=33)
    with job_model(parse_job_config(job), open_dataset(data), weights=True) as model:
        model.eval()
        with torch.no_grad():
            loss = lm_loss(model, ids[:, :-1], ids[:, 1:]).item()
    assert loss == pytest.approx(reference_loss(folder, ids), rel=1e-5)


def test_a_retry_resumes_its_own_checkpoint_exactly_without_reading_the_base_weights(family_data, tools, tmp_path):
    """A run interrupted after its step-5 checkpoint (its step-10 one removed) resumes from step 5
    and ends with the uninterrupted run's loss and weights; the base's shards are not read again
    (one is gone by then)."""
    folder, data = family_data("llama")
    base = _copy(folder, tmp_path / "base")
    job = pretrained_job(tools, base, data, tmp_path / "ck",
                         optim={"max_steps": 10, "warmup_steps": 2, "learning_rate": 1e-3},
                         checkpoint={"interval_steps": 5, "keep_last": 3})
    path = tools.write_job(tmp_path / "job.json", job)
    whole = tools.run_trainer(path, tmp_path / "whole.json")
    assert whole.returncode == 0, whole.stdout[-3000:]
    final = tmp_path / "ck" / ckpt.step_dir_name(10)
    expected = safetensors.torch.load_file(final / ckpt.WEIGHTS)
    shutil.rmtree(final)
    (base / json.loads((base / pretrained.INDEX).read_text())["weight_map"]["model.embed_tokens.weight"]).unlink()
    resumed = tools.run_trainer(path, tmp_path / "resumed.json")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resuming from {tmp_path / 'ck' / ckpt.step_dir_name(5)}" in resumed.stdout
    assert "val/loss_at_start" not in resumed.stdout
    first, second = (json.loads((tmp_path / name).read_text()) for name in ("whole.json", "resumed.json"))
    assert second["final_step"] == 10 and second["final_train_loss"] == first["final_train_loss"]
    got = safetensors.torch.load_file(final / ckpt.WEIGHTS)
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in expected)
