"""``model.init_from``: a registered model's weights start training (real MLflow server).

The tiny Llama of ``tiny_hf_model_dir`` is registered, resolved by the ``train`` task's helper
(trainforge.init_from) to its Hugging Face folder, and loaded by the trainer's one weights-only
loader into a freshly built model: every tensor must equal the registered one before any step.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from trainforge.hooks.mlflow import MlflowHook
from trainforge.init_from import InitSourceError, registered_init
from trainforge.trainer.config import ModelConfig
from trainforge.trainer.errors import ConfigError
from trainforge.storage.files import sha256_file
from trainforge.trainer.model import build_model, llama_config, load_initial_weights

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def registered(mlflow_server: str, tiny_hf_model_dir: Path) -> dict[str, str]:
    hook = MlflowHook(tracking_uri=mlflow_server)
    suffix = uuid.uuid4().hex[:8]
    run_id = hook.get_or_create_run(f"init-{suffix}", "tiny.dag", f"manual__{suffix}")
    name = f"tiny-init-{suffix}"
    result = hook.register_model_version(run_id, tiny_hf_model_dir, name, "ckpt-init",
                                         aliases=["champion"])
    return {"name": name, "version": str(result["version"])}


def _model(tiny_hf_model_dir: Path, hidden_size: int = 16):
    """A fresh model built the way the trainer builds it, from a job config's model section."""
    from transformers import LlamaConfig

    registered = LlamaConfig.from_pretrained(tiny_hf_model_dir)
    section = ModelConfig(family="llama", hidden_size=hidden_size, num_layers=1, num_heads=2,
                          num_kv_heads=2, intermediate_size=32, rope_theta=10_000.0, dropout=0.0,
                          tie_word_embeddings=True)
    torch.manual_seed(1234)  # not the registered model's seed: its weights differ until loaded
    return build_model(llama_config(section, registered.vocab_size, registered.eos_token_id, 64))


def test_init_from_a_registered_model_loads_its_weights_at_step_0(
    mlflow_server: str, registered: dict[str, str], tiny_hf_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    name, version = registered["name"], registered["version"]
    hook = MlflowHook(tracking_uri=mlflow_server)
    init = registered_init(hook, f"models:/{name}@champion", "local",
                           tmp_path / "models", tokenizer_source=f"models:/{name}/{version}")
    assert init["source"] == f"models:/{name}/{version}"
    assert Path(init["checkpoint"]).is_relative_to(tmp_path / "models")

    model = _model(tiny_hf_model_dir)
    expected = LlamaForCausalLM.from_pretrained(tiny_hf_model_dir).state_dict()
    assert not torch.equal(model.state_dict()["model.embed_tokens.weight"],
                           expected["model.embed_tokens.weight"])
    tokenizer = tiny_hf_model_dir / "tokenizer.json"
    load_initial_weights(model, init["checkpoint"], tokenizer, sha256_file(tokenizer))
    got = model.state_dict()
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key

    # a second resolution reuses the downloaded version
    again = registered_init(hook, f"models:/{name}/{version}", "local",
                            tmp_path / "models", tokenizer_source=f"models:/{name}/{version}")
    assert again == init


def test_another_architecture_is_refused_naming_the_field(
    mlflow_server: str, registered: dict[str, str], tiny_hf_model_dir: Path, tmp_path: Path
) -> None:
    name, version = registered["name"], registered["version"]
    init = registered_init(MlflowHook(tracking_uri=mlflow_server),
                           f"models:/{name}/{version}", "local", tmp_path,
                           tokenizer_source=f"models:/{name}/{version}")
    tokenizer = tiny_hf_model_dir / "tokenizer.json"
    with pytest.raises(ConfigError, match=r"hidden_size: model 32, source 16"):
        load_initial_weights(_model(tiny_hf_model_dir, hidden_size=32), init["checkpoint"],
                             tokenizer, sha256_file(tokenizer))


@pytest.mark.parametrize("uri_of,engine,tokenizer_of,fragment", [
    (lambda n, v: f"models:/{n}@nosuch", "local", lambda n, v: f"models:/{n}/{v}",
     "the registry has no such version"),
    (lambda n, v: f"models:/{n}/{v}", "local", lambda n, v: None,
     "the data was encoded with the tokenizer of a newly trained tokenizer"),
    (lambda n, v: f"models:/{n}@champion", "local", lambda n, v: f"models:/{n}/99",
     "but the data was encoded with the tokenizer of models:/"),
    (lambda n, v: f"models:/{n}/{v}", "kubernetes", lambda n, v: f"models:/{n}/{v}",
     "the kubernetes engine reads initial weights from S3"),
])
def test_unusable_init_sources_are_refused_before_launch(
    mlflow_server: str, registered: dict[str, str], tmp_path: Path, uri_of, engine, tokenizer_of,
    fragment,
) -> None:
    name, version = registered["name"], registered["version"]
    with pytest.raises(InitSourceError, match=fragment):
        registered_init(MlflowHook(tracking_uri=mlflow_server),
                        uri_of(name, version), engine, tmp_path, tokenizer_of(name, version))


def test_the_trainer_reads_a_model_folder_from_s3(s3_server, monkeypatch, tiny_hf_model_dir):
    """With an S3 artifact store the train task hands the trainer an s3:// folder URI."""
    from transformers import LlamaForCausalLM

    from trainforge.storage import s3

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    bucket = f"models-{uuid.uuid4().hex[:10]}"
    s3.client().create_bucket(Bucket=bucket)
    for path in tiny_hf_model_dir.iterdir():
        s3.upload_file(path, f"s3://{bucket}/tiny/7/model/{path.name}")
    s3.upload_file(tiny_hf_model_dir / "config.json", f"s3://{bucket}/tiny/7/model/sub/x.json")

    model = _model(tiny_hf_model_dir)
    tokenizer = tiny_hf_model_dir / "tokenizer.json"
    where = load_initial_weights(model, f"s3://{bucket}/tiny/7/model", tokenizer,
                                 sha256_file(tokenizer))
    assert where == f"s3://{bucket}/tiny/7/model"
    expected = LlamaForCausalLM.from_pretrained(tiny_hf_model_dir).state_dict()
    for key, tensor in expected.items():
        assert torch.equal(model.state_dict()[key], tensor), key
