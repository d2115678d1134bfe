"""End to end on the Ray engine: the demo pipeline on the small config, `trainforge run --engine
ray` through `airflow dags test`, with a real Ray head that the run starts on loopback (and
stops), real torchrun (2 ranks, gloo) as the Ray job's entrypoint and a real MLflow server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
SPEC = HERE / "tiny_shakespeare.yaml"

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.distributed, pytest.mark.heavy]


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory, shakespeare_corpus, mlflow_server):
    home = tmp_path_factory.mktemp("trainforge-home-ray")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update({"TRAINFORGE_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow_server})
    summary_path = home / "summary.json"
    trainforge = Path(sys.executable).with_name("trainforge")
    proc = subprocess.run(
        [str(trainforge), "run", str(SPEC), "--engine", "ray", "--summary-json", str(summary_path)],
        env=env, capture_output=True, text=True, timeout=1200,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return home, json.loads(summary_path.read_text()), output


def test_the_pipeline_succeeds_on_a_ray_head_started_for_the_run(ray_run):
    home, summary, output = ray_run
    assert summary["state"] == "success"
    assert {t: s["state"] for t, s in summary["stages"].items()} == {
        "prepare_data": "success", "train": "success",
        "validate_checkpoint": "success", "register_model": "success",
    }
    assert summary["steps_trained"] == 200
    assert summary["val_perplexity"] < 0.8 * summary["unigram_perplexity"], summary
    derived = (home / "specs" / "tiny_shakespeare.ray.yaml").read_text()
    assert "engine: ray" in derived and "address: http://127.0.0.1:" in derived
    assert "Ray head: http://127.0.0.1:" in output


def test_the_train_task_ran_as_a_ray_job_and_streamed_its_log(ray_run, mlflow_server):
    from mlflow import MlflowClient

    home, summary, output = ray_run
    run = MlflowClient(mlflow_server).get_run(summary["mlflow_run_id"])
    assert run.data.tags["trainforge.train.engine"] == "ray"
    full_log = next((home / "logs").iterdir()).read_text()
    # The Ray job's entrypoint line and rank 0's step lines reached the task log via the trigger.
    assert "trainforge: job folder" in full_log
    assert re.search(r"step 200/200", full_log), full_log[-3000:]
    assert "TRAINFORGE_RESULT" in full_log


def test_the_ray_head_is_gone_after_the_run(ray_run):
    _, _, output = ray_run
    temp_dir = re.search(r"temp dir (\S+)\)", output)[1]
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or []):
                left.append(proc)
        except psutil.Error:
            continue
    assert not left, f"Ray processes left after the run: {left}"
    assert not Path(temp_dir).exists()
