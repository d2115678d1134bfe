"""The ``close_run`` teardown under a real ``airflow standalone``: what a failed or killed task
left open is closed once the DAG run's other tasks are done.

* mark failed while the train task is deferred: the job is cancelled (by the trigger, or by the
  teardown if it gets there first), and once the DAG run has ended its MLflow run is ``KILLED``,
  closed by ``close_run`` and tagged; ``close_run`` succeeded and the DAG run failed.
* the same with stages (``fault_tiny_stages``): the stage's child MLflow run, which only its
  task's success would end, is closed ``KILLED`` as well.
* SIGKILL of the task process of a ``deferrable: false`` pipeline with no retry left
  (``fault_tiny_once``): nothing in the task ran ``on_kill``, so the job trains on, orphaned;
  ``close_run`` cancels it and ends the MLflow run ``KILLED``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from faultlib import (
    airflow_logs,
    has_dag,
    mlflow_run,
    steps_logged,
    task_process,
    wait_for,
    wait_job_cancelled,
    wait_run_end,
)
from test_airflow_kill import DAG, start_training

from trainforge.engines.base import JobIdentity

pytestmark = [pytest.mark.airflow, pytest.mark.integration]

ONCE_DAG = "fault_tiny_once"
STAGES_DAG = "fault_tiny_stages"
NOT_SUCCEEDED = "register_model, train, validate_checkpoint"


def assert_closed_by_teardown(server, mlflow_server, dag_id: str, run_id: str) -> None:
    """close_run succeeded and ended the DAG run's MLflow run KILLED, with its tags."""
    close = server.ti(dag_id, run_id, "close_run")
    assert close["state"] == "success", close
    run = mlflow_run(mlflow_server, run_id)
    assert run.info.status == "KILLED", (run.info.status, run.data.tags)
    assert run.data.tags["trainforge.closed_by"] == "close_run"
    assert run.data.tags["trainforge.close_run.tasks_not_succeeded"] == NOT_SUCCEEDED


def test_mark_failed_while_deferred_cancels_the_job_and_the_teardown_closes_the_run(
        airflow_standalone, mlflow_server):
    server = airflow_standalone
    run_id, path = start_training(server, max_steps=200_000)
    assert mlflow_run(mlflow_server, run_id).info.status == "RUNNING"
    server.set_state(DAG, run_id, "train", "failed")
    assert wait_run_end(server, DAG, run_id) == "failed", server.tail()
    wait_job_cancelled(path)
    assert server.ti(DAG, run_id, "validate_checkpoint")["state"] == "upstream_failed"
    assert_closed_by_teardown(server, mlflow_server, DAG, run_id)
    logs = airflow_logs(server, run_id, DAG)
    assert "Tasks that did not succeed: register_model (upstream_failed), train (failed)" in logs
    assert "KILLED" in logs and "Ended MLflow run" in logs, logs[-3000:]


def test_sigkilled_task_process_without_retry_leaves_a_job_the_teardown_cancels(
        airflow_standalone, mlflow_server):
    server = airflow_standalone
    wait_for(f"the {ONCE_DAG} DAG", lambda: has_dag(server, ONCE_DAG), 120, 0.5)
    run_id = server.trigger(ONCE_DAG, {"max_steps": 200_000})
    path = server.home / "runs" / JobIdentity(ONCE_DAG, run_id, "train", 1).key
    wait_for("rank 0's first step line", lambda: steps_logged(path), 420, 1)
    ti = server.ti(ONCE_DAG, run_id, "train")
    assert ti["state"] == "running", ti  # waiting in its worker slot
    proc = wait_for("the train task's process", lambda: task_process(ti["id"]), 60, 1)
    proc.kill()  # a lost worker: no on_kill runs, nothing cancels the job
    assert wait_run_end(server, ONCE_DAG, run_id) == "failed", server.tail()
    ti = server.ti(ONCE_DAG, run_id, "train")
    assert (ti["state"], ti["try_number"]) == ("failed", 1), ti
    wait_job_cancelled(path)
    key = JobIdentity(ONCE_DAG, run_id, "train", 1).key
    close_log = "\n".join(
        p.read_text(errors="replace") for p in (
            Path(server.env["AIRFLOW_HOME"]) / "logs" / f"dag_id={ONCE_DAG}"
            / f"run_id={run_id}" / "task_id=close_run").rglob("*.log*"))
    assert f"cancelling job {key}" in close_log, close_log[-3000:]
    assert_closed_by_teardown(server, mlflow_server, ONCE_DAG, run_id)
    assert mlflow_run(mlflow_server, run_id).data.tags[
        "trainforge.close_run.cancelled_jobs"] == key


def test_a_stage_marked_failed_while_deferred_has_its_child_run_closed(airflow_standalone,
                                                                       mlflow_server):
    from mlflow import MlflowClient

    server = airflow_standalone
    wait_for(f"the {STAGES_DAG} DAG", lambda: has_dag(server, STAGES_DAG), 120, 0.5)
    run_id = server.trigger(STAGES_DAG, {"max_steps": 200_000})
    path = server.home / "runs" / JobIdentity(STAGES_DAG, run_id, "train_pretrain", 1).key
    wait_for("the stage's task to defer", lambda: server.ti(
        STAGES_DAG, run_id, "train_pretrain")["state"] == "deferred" or None, 420, 0.5)
    wait_for("rank 0's first step line", lambda: steps_logged(path), 180, 1)
    parent = mlflow_run(mlflow_server, run_id)
    client = MlflowClient(mlflow_server)

    def child():
        [found] = client.search_runs([parent.info.experiment_id],
                                     f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        return found

    assert child().info.status == "RUNNING"
    server.set_state(STAGES_DAG, run_id, "train_pretrain", "failed")
    assert wait_run_end(server, STAGES_DAG, run_id) == "failed", server.tail()
    wait_job_cancelled(path)
    assert server.ti(STAGES_DAG, run_id, "close_run")["state"] == "success"
    not_succeeded = "register_model, train_pretrain, validate_checkpoint"
    for run in (mlflow_run(mlflow_server, run_id), child()):
        assert run.info.status == "KILLED", (run.info.status, run.data.tags)
        assert run.data.tags["trainforge.closed_by"] == "close_run"
        assert run.data.tags["trainforge.close_run.tasks_not_succeeded"] == not_succeeded
    assert child().data.tags["trainforge.stage"] == "pretrain"
