"""End to end: continued training from a registered model (`model.init_from: models:/...`).

Two pipelines through `airflow dags test` against one real MLflow server: the first trains and
registers a tiny model; the second starts from its `champion` version, reuses its tokenizer, and
is validated and registered in turn. Checks the whole chain — resolving the version in the train
task, the trainer loading its weights, and the validator accepting the checkpoint whose job
config carries the same `init` block (also under `airflow dags test`, which resumes a deferred
task without the deferral's kwargs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
BASE = HERE / "tiny_shakespeare.yaml"
MODEL = "tiny-continued"

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.distributed, pytest.mark.heavy]


def _spec(tmp: Path, name: str, **changes) -> Path:
    spec = yaml.safe_load(BASE.read_text())
    spec["pipeline"]["name"] = name
    spec["registry"]["model_name"] = MODEL
    opt = spec["training"]["optimization"]
    opt.update(max_steps=20, warmup_steps=2)
    spec["training"]["checkpoint"]["interval_steps"] = 20
    spec["validation"]["require_beats_unigram"] = False  # 20 steps: only the chain is tested
    for section, values in changes.items():
        spec[section].update(values)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _run(spec: Path, home: Path, mlflow_server: str) -> dict:
    env = {**os.environ, "TRAINFORGE_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow_server}
    summary = home / f"{spec.stem}-summary.json"
    trainforge = Path(sys.executable).with_name("trainforge")
    proc = subprocess.run([str(trainforge), "run", str(spec), "--summary-json", str(summary)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(summary.read_text())


@pytest.fixture(scope="module")
def continued(tmp_path_factory, shakespeare_corpus, mlflow_server):
    home = tmp_path_factory.mktemp("trainforge-home")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    first = _run(_spec(home, "tiny_base"), home, mlflow_server)
    source = f"models:/{MODEL}@champion"
    second_spec = _spec(
        home, "tiny_continued",
        model={"init_from": source},
        data={"tokenizer": {"source": source, "vocab_size": 1024}},
    )
    second = _run(second_spec, home, mlflow_server)
    return first, second, source


def test_second_pipeline_starts_from_the_registered_weights(continued):
    first, second, source = continued
    assert first["state"] == "success" and second["state"] == "success"
    meta = json.loads((Path(second["checkpoint"]) / "meta.json").read_text())
    init = meta["job_config"]["init"]
    assert init["source"].startswith(f"models:/{MODEL}/"), init  # resolved to a version
    assert Path(init["checkpoint"]).exists() or init["checkpoint"].startswith("s3://")


def test_the_continued_checkpoint_is_validated_and_registered_as_a_new_version(
        continued, mlflow_server):
    from mlflow import MlflowClient

    first, second, _ = continued
    client = MlflowClient(mlflow_server)
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name='{MODEL}'"))
    assert versions == [1, 2]
    v2 = client.get_model_version(MODEL, "2")
    assert v2.status == "READY"
    assert v2.run_id == second["mlflow_run_id"] != first["mlflow_run_id"]
    # Starting from the first model's weights, the first logged loss is already near its end
    # loss, far below the loss of random weights (about ln(1024) = 6.9).
    history = client.get_metric_history(second["mlflow_run_id"], "train_loss")
    first_loss = min(history, key=lambda m: m.step).value
    assert first_loss < 6.0, first_loss
