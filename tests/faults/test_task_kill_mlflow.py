"""The train task killed (SIGTERM -> ``on_kill``): the job is cancelled and the MLflow run ends
KILLED; the next try reopens the run. Real local job (the backend tests' stand-in workload) and
a real MLflow server; the operator is driven directly, as Airflow's task runner does on SIGTERM.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.local.backend import LocalBackend
from trainforge.pipeline.loader import load_spec
from trainforge.tasks.train import TrainOperator

pytestmark = [pytest.mark.integration]

HERE = Path(__file__).resolve().parent
FAKE_DIR = HERE.parent / "operators" / "engines"


@pytest.fixture
def setup(tmp_path, monkeypatch, mlflow_server):
    import mlflow

    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    spec = load_spec(HERE / "fault_tiny.yaml")
    client = mlflow.MlflowClient(mlflow_server)
    run_id = client.create_run(client.create_experiment(f"kill-{time.time_ns()}")).info.run_id
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKE_DIR))
    handle = backend.submit(TrainingJob(
        identity=JobIdentity("fault_tiny", "r1", "train", 1),
        config={"fake": {"lines": 1, "sleep_s": 120}}, module="fake_trainer",
    ))
    op = TrainOperator(task_id="train", spec=spec.model_dump(mode="json"),
                       mlflow_tracking_uri=mlflow_server)
    op._handle, op._mlflow_run_id = handle, run_id
    yield op, backend, handle, client, run_id, spec
    backend.cancel(handle, grace_s=5)


def test_sigterm_cancels_the_job_and_ends_the_run_killed(setup):
    op, backend, handle, client, run_id, _ = setup
    assert backend.status(handle).state == JobState.RUNNING
    op.on_kill()
    assert backend.status(handle).state == JobState.CANCELLED
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["trainforge.killed_task"] == "train"
    # The retry's execute reopens the run: RUNNING again, and says which try did it.
    op._reopen_mlflow_run(run_id, 2)
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"
    assert run.data.tags["trainforge.train.reopened_by_try_2"] == "KILLED"


def test_cancel_on_kill_false_keeps_the_job_and_its_run_running(setup):
    op, backend, handle, client, run_id, spec = setup
    data = spec.model_dump(mode="json")
    data["training"]["fault"]["cancel_on_kill"] = False
    op.spec = data
    op.on_kill()
    assert backend.status(handle).state == JobState.RUNNING
    assert client.get_run(run_id).info.status == "RUNNING"
