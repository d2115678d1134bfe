"""LoRA registered unmerged (``training.peft.merge: false``): the export holds peft's adapter
files and no full weights, the registry version references the base's local folder (and tags
the base weights' digest), and ``mlflow.transformers.load_model("models:/...")`` loads base plus
adapter and generates what the trained model generates; against a real MLflow server.

The adapters are a checkpoint written here (random, B non-zero: they change the output), not
trained: the training side of LoRA is tests/trainer/test_lora.py's. An MLflow whose
``save_model`` takes no ``base_model_path`` (3.11.1) is refused before anything is uploaded.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import build_dataset
from tests.trainer.test_pretrained import _eos_token, pretrained_job
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.adapters import adapter_weights, apply_lora, base_digest, checkpoint_model
from trainforge.trainer.config import parse_job_config
from trainforge.trainer.data import open_dataset
from trainforge.trainer.export import ADAPTER_CONFIG, EXPORT_INFO, export_checkpoint
from trainforge.trainer.model import job_model

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

LORA = {"method": "lora", "r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "auto", "merge": False}


@pytest.fixture(scope="module")
def adapter_checkpoint(hf_model, tools, tmp_path_factory):
    """``(step_dir, dataset, base folder)``: a LoRA checkpoint of ``merge: false`` on tiny qwen3."""
    folder = hf_model("qwen3")
    root = tmp_path_factory.mktemp("lora-unmerged")
    data = build_dataset(root / "ds", n_train=8, n_val=2, tokenizer_file=folder / "tokenizer.json",
                         eos_token=_eos_token(folder))
    job = pretrained_job(tools, folder, data, root / "ck")
    job["peft"] = dict(LORA)
    cfg, dataset = parse_job_config(job), open_dataset(data)
    with job_model(cfg, dataset, weights=True) as model:
        apply_lora(model, cfg.peft)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.normal_(std=0.05)
        weights = adapter_weights(model)
    meta = {"step": 4, "job_config": job, "dataset": {"tokenizer_sha256": dataset.tokenizer_sha256},
            "adapter": {"method": "lora", "base_sha256": base_digest(folder)}}
    step_dir = ckpt.write_checkpoint(root / "ck", 4, weights, {"state": {}, "param_groups": []}, {"step": 4}, meta)
    return Path(step_dir), data, folder


@pytest.mark.integration
def test_the_unmerged_adapter_registers_alone_and_generates_what_the_trained_model_generates(
        adapter_checkpoint, mlflow_server, tmp_path, monkeypatch):
    import mlflow.transformers
    from mlflow import MlflowClient
    from peft import PeftModel

    from trainforge.hooks.mlflow import MlflowHook
    from trainforge.model_card import base_model_tags

    step_dir, data, folder = adapter_checkpoint
    out = export_checkpoint(step_dir, data, tmp_path / "hf")  # merge from the checkpoint's job config: false
    files = {p.name for p in out.iterdir()}
    assert {ADAPTER_CONFIG, "adapter_model.safetensors", "tokenizer.json"} <= files
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in files)  # no full weights
    info = json.loads((out / EXPORT_INFO).read_text())
    assert info["adapter"]["base_sha256"] == base_digest(folder)
    assert info["base_model"]["folder"] == str(folder.resolve())

    client = MlflowClient(mlflow_server)
    run_id = client.create_run(client.create_experiment(f"lora-unmerged-{uuid.uuid4().hex[:8]}")).info.run_id
    name = f"tiny-lora-adapter-{uuid.uuid4().hex[:8]}"
    prepared = {"pretrained": {"source": str(folder), "folder": str(folder), "revision": None}}
    registered = MlflowHook(tracking_uri=mlflow_server).register_model_version(
        run_id=run_id, model_dir=str(out), registered_model_name=name, idempotency_key=f"{run_id}:adapter",
        tags=base_model_tags(prepared, out), ready_timeout_s=60)
    tags = client.get_model_version(name, registered["version"]).tags
    assert tags["trainforge.registered_weights"] == "adapter"
    assert tags["trainforge.base_model.folder"] == str(folder.resolve())
    assert tags["trainforge.adapter.base_sha256"] == base_digest(folder)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # never mlflow.set_tracking_uri: it outlives the test
    uri = f"models:/{name}/{registered['version']}"
    flavor = mlflow.models.get_model_info(uri).flavors["transformers"]
    assert flavor["local_base_model_path"] == str(folder.resolve()) and flavor.get("peft_adaptor")
    components = mlflow.transformers.load_model(uri, return_type="components")
    model, tokenizer = components["model"], components["tokenizer"]
    assert isinstance(model, PeftModel)  # the base from its folder, the adapter from the registry
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Where does the river start?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    got = model.float().eval().generate(**prompt, max_new_tokens=8, do_sample=False)
    c = ckpt.load_checkpoint(step_dir)
    with checkpoint_model(parse_job_config(c.meta["job_config"]), open_dataset(data), c.weights) as trained:
        expected = trained.eval().generate(**prompt, max_new_tokens=8, do_sample=False)
        with torch.no_grad(), model.disable_adapter():  # the adapters matter: the base alone answers otherwise
            assert not torch.allclose(trained(**prompt).logits, model.float()(**prompt).logits, atol=1e-3)
    assert torch.equal(got, expected)


def test_an_mlflow_without_base_model_path_is_refused_before_any_upload(tmp_path):
    from importlib.metadata import version

    from trainforge.hooks.mlflow_model_links import (AdapterRegistrationError, adapter_model,
                                                     adapter_registration_problem)

    def old_save_model(transformers_model, path, task=None, mlflow_model=None, pip_requirements=None):
        """mlflow.transformers.save_model as MLflow 3.11.1 has it: no base_model_path."""

    assert adapter_registration_problem() is None  # the installed MLflow takes base_model_path
    problem = adapter_registration_problem(old_save_model)
    assert f"the installed mlflow {version('mlflow')} does not" in problem
    assert "base_model_path" in problem and "training.peft.merge: true" in problem
    (tmp_path / ADAPTER_CONFIG).write_text("{}")  # refused before the folder is read
    with pytest.raises(AdapterRegistrationError, match="takes base_model_path"):
        adapter_model(tmp_path, save_model=old_save_model)
    (tmp_path / EXPORT_INFO).write_text(json.dumps({"base_model": {"folder": None}}))  # an s3:// base
    with pytest.raises(AdapterRegistrationError, match="names no local base model folder"):
        adapter_model(tmp_path)
