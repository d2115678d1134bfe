"""End to end: a chat fine-tuning pipeline with LoRA (issue 39), through `trainforge run`
(`airflow dags test` underneath) against a real MLflow server.

A tiny random-weight Qwen3-family model the test saves in Hugging Face layout (ChatML template);
chat data, eval prompts and a chat template of its own (in place of the base's) the test writes. prepare_data renders the conversations with the
model's template into an examples dataset, the trainer trains LoRA adapters on 2 ranks with the
loss on the answers only, the adapters-only checkpoint is validated, the merged weights are
registered with the task score the eval gate measured, and the registered version loads offline
and generates what the trained model (base plus adapters) generates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml

from tests.hf_models import make_hf_model
from trainforge.data.plays_chat import CHAT_TEMPLATE

HERE = Path(__file__).resolve().parent
MODEL = "tiny-chat-lora"
WORDS = ["river", "bridge", "mill", "market", "school", "garden", "church", "bakery", "valley", "hills"]

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.distributed]


def _conversations() -> list[dict]:
    out = []
    for i, word in enumerate(WORDS * 6):
        out.append({"messages": [{"role": "system", "content": "Answer with one word."},
                                 {"role": "user", "content": f"Repeat the word {word}, turn {i}."},
                                 {"role": "assistant", "content": word}]})
    return out


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, mlflow_server):
    home = tmp_path_factory.mktemp("trainforge-home")
    base = make_hf_model(home / "models" / "tiny-qwen3", "qwen3")
    (home / "chat").mkdir()
    (home / "chat" / "talks.jsonl").write_text("".join(json.dumps(c) + "\n" for c in _conversations()))
    (home / "chat" / "template.jinja").write_text(CHAT_TEMPLATE)  # in place of the base's ChatML
    (home / "eval").mkdir()
    (home / "eval" / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"Repeat the word {w}.", "expected": w}) + "\n" for w in WORDS[:4]))
    spec = yaml.safe_load((HERE / "tiny_shakespeare.yaml").read_text())
    spec["pipeline"]["name"] = "tiny_chat_lora"
    spec["registry"]["model_name"] = MODEL
    spec["registry"]["eval"] = {"prompts": "eval/prompts.jsonl", "scoring": "exact_match", "max_new_tokens": 4}
    spec["data"] = {"format": "chat", "sources": ["chat/*.jsonl"], "sequence_length": 64,
                    "validation_fraction": 0.2, "chat_template": "chat/template.jinja"}
    spec["model"] = {"pretrained": "models/tiny-qwen3"}  # relative to TRAINFORGE_HOME
    spec["training"]["optimization"].update(max_steps=16, warmup_steps=2, learning_rate=3e-3,
                                            global_batch_size=8, micro_batch_size=2)
    spec["training"]["checkpoint"]["interval_steps"] = 8
    spec["training"]["peft"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    spec["validation"]["require_beats_unigram"] = False  # a random base model: the chain is tested
    path = home / "tiny_chat_lora.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "TRAINFORGE_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow_server,
           "HF_HUB_OFFLINE": "1"}
    summary = home / "summary.json"
    proc = subprocess.run([str(Path(sys.executable).with_name("trainforge")), "run", str(path),
                           "--summary-json", str(summary)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(summary.read_text()), base, proc.stdout


def test_the_chat_data_trains_lora_adapters_on_the_answers_only(pipeline, mlflow_server):
    from mlflow import MlflowClient

    summary, base, _ = pipeline
    assert summary["state"] == "success"
    step_dir = Path(summary["checkpoint"])
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["job_config"]["peft"]["r"] == 4 and meta["adapter"]["method"] == "lora"
    weights = safetensors.torch.load_file(step_dir / "model.safetensors")
    assert weights and all(".lora_" in name for name in weights)  # the adapters alone
    client = MlflowClient(mlflow_server)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.metrics["data/train_loss_tokens"] > 0 and run.data.metrics["data/validation_loss_tokens"] > 0
    history = client.get_metric_history(run.info.run_id, "loss_tokens")
    assert history and all(0 < m.value < 8 * 64 for m in history)  # answers only: far fewer than the tokens
    dataset = json.loads(Path(meta["job_config"]["data"]["dataset_dir"], "manifest.json").read_text())
    assert dataset["examples"]["kind"] == "chat"


def test_the_task_score_is_measured_before_and_after_fine_tuning(pipeline, mlflow_server):
    from mlflow import MlflowClient

    summary, _, stdout = pipeline
    metrics = MlflowClient(mlflow_server).get_run(summary["mlflow_run_id"]).data.metrics
    assert 0.0 <= metrics["eval/task_score"] <= 1.0 and 0.0 <= metrics["eval/task_score_base"] <= 1.0
    assert (summary["task_score"], summary["base_task_score"]) == (metrics["eval/task_score"],
                                                                   metrics["eval/task_score_base"])
    assert f"{metrics['eval/task_score']:.3f} after fine-tuning; {metrics['eval/task_score_base']:.3f} before" \
        in " ".join(stdout.split())


def test_the_registered_merged_version_generates_what_the_trained_model_generates(pipeline, mlflow_server,
                                                                                    monkeypatch):
    import mlflow.transformers
    from mlflow import MlflowClient

    from trainforge.trainer import checkpoint as ckpt
    from trainforge.trainer.adapters import checkpoint_model
    from trainforge.trainer.config import parse_job_config
    from trainforge.trainer.data import open_dataset

    summary, base, _ = pipeline
    (version,) = MlflowClient(mlflow_server).search_model_versions(f"name='{MODEL}'")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # never mlflow.set_tracking_uri: it outlives the test
    components = mlflow.transformers.load_model(f"models:/{MODEL}/{version.version}", return_type="components")
    model, tokenizer = components["model"], components["tokenizer"]
    assert not any("lora" in name for name in model.state_dict())  # merged full weights
    assert tokenizer.chat_template == CHAT_TEMPLATE  # the template it was trained with, not the base's
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat the word mill."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    got = model.float().generate(**prompt, max_new_tokens=6, do_sample=False)
    c = ckpt.load_checkpoint(summary["checkpoint"])
    cfg = parse_job_config(c.meta["job_config"])
    with checkpoint_model(cfg, open_dataset(cfg.data.dataset_dir), c.weights) as trained:
        expected = trained.eval().generate(**prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)
