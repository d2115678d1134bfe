"""trainforge.trainer.export: the HF folder loads with transformers, matches the checkpoint, and generates."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.config import parse_job_config
from trainforge.trainer.errors import CheckpointError, ConfigError
from trainforge.trainer.export import export_checkpoint, main
from trainforge.trainer.model import build_model, llama_config, load_weights


@pytest.fixture(scope="module")
def hf_dir(trained_run, dataset_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    export_checkpoint(trained_run["checkpoints"] / "step-00000020", dataset_dir, out)
    return out


def test_export_folder_contents(hf_dir):
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "trainforge_export.json"} <= names
    assert not [p for p in hf_dir.parent.iterdir() if p.name.startswith(".hf.tmp")]
    info = json.loads((hf_dir / "trainforge_export.json").read_text())
    assert info["step"] == 20 and len(info["checkpoint_digest"]) == 64
    assert (hf_dir / "model.safetensors").stat().st_mode & 0o044  # readable by group/others (umask 022)


def test_export_loads_and_matches_the_checkpoint(hf_dir, trained_run, dataset_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert tok.eos_token == tok.pad_token == tok.bos_token == "<|endoftext|>" and tok.eos_token_id == 0

    c = ckpt.load_checkpoint(trained_run["checkpoints"] / "step-00000020")
    cfg = parse_job_config(c.meta["job_config"])
    ours = build_model(llama_config(cfg.model, 320, 0, cfg.data.sequence_length)).eval()
    load_weights(ours, c.weights)
    ids = torch.tensor([tok("ROMEO: the king")["input_ids"]])  # (1, n)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=0, atol=1e-6)
    assert tok.decode(tok("ROMEO: the king")["input_ids"]) == "ROMEO: the king"


def test_pipeline_generates(hf_dir):
    from transformers import pipeline

    out = pipeline("text-generation", model=str(hf_dir))("ROMEO:", max_new_tokens=8, do_sample=False)
    assert out[0]["generated_text"].startswith("ROMEO:") and len(out[0]["generated_text"]) > len("ROMEO:")


def test_export_refuses_bad_inputs(trained_run, dataset_dir, tmp_path, capsys):
    step_dir = trained_run["checkpoints"] / "step-00000020"
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not an empty directory"):
        export_checkpoint(step_dir, dataset_dir, taken)

    broken = shutil.copytree(step_dir, tmp_path / "ck" / step_dir.name)
    (broken / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match="does not verify: .*meta.json"):
        export_checkpoint(broken, dataset_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    assert main(["--checkpoint", str(broken), "--dataset", str(dataset_dir), "--out", str(tmp_path / "o")]) == 1
    assert main(["--checkpoint", str(step_dir), "--dataset", str(dataset_dir), "--out", str(taken)]) == 78
    assert "trainforge.trainer.export:" in capsys.readouterr().err


def test_mlflow_transformers_log_model_accepts_the_folder(hf_dir, tmp_path, monkeypatch):
    """mlflow.transformers.log_model(transformers_model=HF_DIR, task="text-generation") and load back.

    pip_requirements is passed because mlflow's default requirements for a torch model pin
    torchvision, which this stack does not install (mlflow/transformers/__init__.py).
    """
    import mlflow

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:  # artifacts under tmp_path, not ./mlruns in the checkout
        experiment = mlflow.create_experiment("export", artifact_location=(tmp_path / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=experiment):
            info = mlflow.transformers.log_model(transformers_model=str(hf_dir), task="text-generation", name="model",
                                                 pip_requirements=["torch==2.13.0", "transformers==5.17.0"])
        pipe = mlflow.transformers.load_model(info.model_uri)
        assert pipe("ROMEO:", max_new_tokens=4, do_sample=False)[0]["generated_text"].startswith("ROMEO:")
    finally:
        mlflow.set_tracking_uri(None)
