"""End to end: a pipeline that fine-tunes open weights (`model.pretrained: <folder>`).

One `trainforge run` (Airflow's `airflow dags test` underneath) against a real MLflow server, on a
tiny random-weight Mistral the test saves in Hugging Face layout (bf16 shards, its own tokenizer
and chat template): prepare encodes with the model's tokenizer, the trainer loads the shards on 2
ranks, the checkpoint is validated and registered, and the registered version loads offline with
`mlflow.transformers.load_model` and generates through the base's chat template.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.hf_models import make_hf_model

HERE = Path(__file__).resolve().parent
MODEL = "tiny-open-weights"

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.distributed]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, shakespeare_corpus, mlflow_server):
    home = tmp_path_factory.mktemp("trainforge-home")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    base = make_hf_model(home / "models" / "tiny-mistral", "mistral")
    spec = yaml.safe_load((HERE / "tiny_shakespeare.yaml").read_text())
    spec["pipeline"]["name"] = "tiny_open_weights"
    spec["registry"]["model_name"] = MODEL
    del spec["data"]["tokenizer"]
    spec["model"] = {"pretrained": "models/tiny-mistral"}  # relative to TRAINFORGE_HOME
    spec["training"]["optimization"].update(max_steps=20, warmup_steps=2, learning_rate=1e-3)
    spec["training"]["checkpoint"]["interval_steps"] = 20
    spec["validation"]["require_beats_unigram"] = False  # a random base model: the chain is tested
    path = home / "tiny_open_weights.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "TRAINFORGE_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow_server,
           "HF_HUB_OFFLINE": "1"}
    summary = home / "summary.json"
    proc = subprocess.run([str(Path(sys.executable).with_name("trainforge")), "run", str(path),
                           "--summary-json", str(summary)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(summary.read_text()), base


def test_the_open_weights_are_trained_from_their_loss_at_start(pipeline, mlflow_server):
    from mlflow import MlflowClient

    summary, base = pipeline
    assert summary["state"] == "success"
    meta = json.loads((Path(summary["checkpoint"]) / "meta.json").read_text())
    assert meta["job_config"]["pretrained"] == {"folder": str(base), "source": "models/tiny-mistral",
                                                "revision": None}
    assert meta["job_config"]["model"]["family"] == "pretrained"
    client = MlflowClient(mlflow_server)
    start = client.get_metric_history(summary["mlflow_run_id"], "val/loss_at_start")
    assert len(start) == 1 and start[0].step == 0


def test_the_registered_version_loads_offline_and_generates_with_the_base_template(pipeline, mlflow_server,
                                                                                    monkeypatch):
    import mlflow.transformers
    from mlflow import MlflowClient

    summary, base = pipeline
    client = MlflowClient(mlflow_server)
    (version,) = client.search_model_versions(f"name='{MODEL}'")
    assert version.tags["trainforge.base_model"] == "models/tiny-mistral"
    assert version.tags["trainforge.base_model.license"] == "apache-2.0"
    assert len(version.tags["trainforge.base_model.weights_index_sha256"]) == 64
    assert "fine-tuned from `models/tiny-mistral`" in version.description
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # never mlflow.set_tracking_uri: it outlives the test
    components = mlflow.transformers.load_model(f"models:/{MODEL}/{version.version}", return_type="components")
    model, tokenizer = components["model"], components["tokenizer"]
    assert type(model).__name__ == "MistralForCausalLM"
    assert tokenizer.chat_template and tokenizer.eos_token == "</s>"
    from transformers import AutoTokenizer

    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(base).get_vocab()  # the base's own
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Who is Hamlet?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
