"""End to end on the Slurm engine: the demo pipeline on the small config, `trainforge run
--engine slurm` through `airflow dags test`, with the train task submitted by sbatch to a real
one-node Slurm cluster (the ``slurm_cluster`` fixture), real srun + torchrun (2 ranks, gloo) and
the run's own MLflow server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import shakespeare_corpus  # noqa: F401 - the demo corpus (session)
from tests.slurm_cluster import slurm_cluster  # noqa: F401 - the session's Slurm cluster

SPEC = Path(__file__).resolve().parents[3] / "e2e" / "tiny_shakespeare.yaml"

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.distributed]


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory, shakespeare_corpus, slurm_cluster):  # noqa: F811
    home = tmp_path_factory.mktemp("trainforge-home-slurm")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    # The derived spec's training.slurm.python is the default `python3`: the job inherits the
    # submitter's PATH (sbatch --export=ALL), so this environment's Python runs the trainer.
    env.update({"TRAINFORGE_HOME": str(home), **slurm_cluster.env(),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    summary_path = home / "summary.json"
    trainforge = Path(sys.executable).with_name("trainforge")
    proc = subprocess.run(
        [str(trainforge), "run", str(SPEC), "--engine", "slurm", "--summary-json",
         str(summary_path)],
        env=env, capture_output=True, text=True, timeout=1500,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return home, json.loads(summary_path.read_text()), output


def test_the_pipeline_succeeds_with_training_as_a_slurm_job(slurm_run, slurm_cluster):  # noqa: F811
    home, summary, _ = slurm_run
    assert summary["state"] == "success"
    assert {t: s["state"] for t, s in summary["stages"].items()} == {
        "prepare_data": "success", "train": "success",
        "validate_checkpoint": "success", "register_model": "success",
    }
    assert summary["steps_trained"] == 200
    assert summary["val_perplexity"] < 0.8 * summary["unigram_perplexity"], summary
    assert "engine: slurm" in (home / "specs" / "tiny_shakespeare.slurm.yaml").read_text()
    (job_dir,) = (home / "runs").iterdir()
    record = json.loads((job_dir / "slurm_job.json").read_text())
    state = slurm_cluster.run("squeue", "-j", record["job_id"], "--states=all", "-h",
                              "-o", "%T|%j").stdout.strip()
    assert state == f"COMPLETED|{job_dir.name}"
    assert json.loads((job_dir / "exit.json").read_text())["exit_code"] == 0


def test_the_slurm_jobs_log_reached_the_task_log(slurm_run):
    home, summary, _ = slurm_run
    full_log = next((home / "logs").iterdir()).read_text()
    assert "trainforge: Slurm job" in full_log and "rendezvous localhost:" in full_log
    assert "step 200/200" in full_log, full_log[-3000:]
