"""Kills of the Airflow task process itself, and a real execution_timeout, under a real
``airflow standalone`` (scheduler, triggerer, API server, LocalExecutor workers).

``fault_tiny_sync`` waits for its job in the worker slot (``fault.deferrable: false``), so the
train task's process — the Task SDK child ``airflow worker -- <task instance id>`` under its
supervisor — is alive during the job and can be signalled:

* SIGTERM (a worker shutdown): the task ends up for retry (or failed), never success; the job is
  cancelled once; the MLflow run ends KILLED; downstream does not run; no job process is left.
* SIGKILL (a lost worker) while the job runs: try 2 adopts try 1's running job (no second job)
  and the run finishes at the planned step.
* SIGKILL while the job is about to finish: try 2 finds the job succeeded and goes straight to
  its outputs; validation and registration succeed.

``fault_tiny_deadline`` (deferrable) has a 45 s ``execution_timeout`` on train and a job far
longer: the task fails about 45 s after its first start, across the deferral, and the job is
cancelled.

To keep try 1's outcome observable, the DAG is paused around a kill: the scheduler does not
start try 2 of a paused DAG's run (its runs are not examined), the Task SDK supervisor still
records try 1's end.
"""

from __future__ import annotations

import datetime as dt
import signal
from pathlib import Path

import psutil
import pytest
from faultlib import (
    CANCEL_WITHIN_S,
    airflow_logs,
    exit_record,
    has_dag,
    job_processes,
    mlflow_run,
    mlflow_steps,
    steps_logged,
    task_process,
    wait_for,
    wait_run_end,
)
from holds import ranks_held

from trainforge.engines.base import JobIdentity

pytestmark = [pytest.mark.airflow, pytest.mark.integration]

SYNC_DAG = "fault_tiny_sync"
DEADLINE_DAG = "fault_tiny_deadline"
DEADLINE_EXECUTION_TIMEOUT_S = 45  # fault_tiny_deadline.yaml pipeline.tasks.train


def job_dir(home: Path, dag_id: str, run_id: str, try_number: int = 1) -> Path:
    return home / "runs" / JobIdentity(dag_id, run_id, "train", try_number).key


def set_paused(server, dag_id: str, paused: bool) -> None:
    server.api("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": paused})


def start_waiting(server, max_steps: int) -> tuple[str, Path, psutil.Process]:
    """Trigger ``fault_tiny_sync``; return once rank 0 logs steps while the train task's own
    process waits on the job: (run id, job folder, that task process)."""
    wait_for(f"the {SYNC_DAG} DAG", lambda: has_dag(server, SYNC_DAG), 120, 0.5)
    run_id = server.trigger(SYNC_DAG, {"max_steps": max_steps})
    path = job_dir(server.home, SYNC_DAG, run_id)
    wait_for("rank 0's first step line", lambda: steps_logged(path), 420, 1)
    ti = server.ti(SYNC_DAG, run_id, "train")
    assert ti["state"] == "running", ti  # waiting in its worker slot, not deferred
    proc = wait_for("the train task's process", lambda: task_process(ti["id"]), 60, 1)
    return run_id, path, proc


def wait_try_ended(server, run_id: str) -> dict:
    return wait_for("try 1 of train to end", lambda: (
        lambda ti: ti if ti["state"] in ("up_for_retry", "failed", "success") else None)(
        server.ti(SYNC_DAG, run_id, "train")), 180, 1)


def try_log(server, dag_id: str, run_id: str, try_number: int) -> str:
    """The train task's log file of one try (the trigger's lines included)."""
    root = (Path(server.env["AIRFLOW_HOME"]) / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
            / "task_id=train")
    return "\n".join(p.read_text(errors="replace")
                     for p in sorted(root.rglob(f"attempt={try_number}.log*")))


def test_sigterm_to_the_waiting_task_process_cancels_the_job_and_never_succeeds(
        airflow_standalone, mlflow_server):
    server = airflow_standalone
    run_id, path, proc = start_waiting(server, max_steps=200_000)
    key = JobIdentity(SYNC_DAG, run_id, "train", 1).key
    set_paused(server, SYNC_DAG, True)  # try 1's end stays visible: no try 2 yet
    try:
        proc.send_signal(signal.SIGTERM)
        ti = wait_try_ended(server, run_id)
        assert (ti["state"], ti["try_number"]) in (("up_for_retry", 1), ("failed", 1)), ti
        record = wait_for("the job's exit record", lambda: exit_record(path), CANCEL_WITHIN_S)
        assert record["cancelled"] is True
        wait_for("no process of the job", lambda: not job_processes(path), 30)
        run = mlflow_run(mlflow_server, run_id)
        assert run.info.status == "KILLED" and run.data.tags["trainforge.killed_task"] == "train"
        assert server.ti(SYNC_DAG, run_id, "validate_checkpoint")["state"] is None
        log = try_log(server, SYNC_DAG, run_id, 1)
        assert f"[{key}] " in log  # rank 0's lines reached the task log during the wait
        assert f"Task killed: cancelling job {key}" in log, log[-3000:]
        assert "got SIGTERM while it waited on job" in log and "the job was cancelled" in log
        # Cancelled exactly once, by on_kill; the trigger's own cancel path kept quiet.
        assert log.count(f"Cancelling local job {key}") == 1, log[-3000:]
        assert "in the task process stopped" in log and "while deferred" not in log
    finally:
        set_paused(server, SYNC_DAG, False)


def test_sigkilled_task_process_is_retried_and_the_retry_adopts_the_running_job(
        airflow_standalone, mlflow_server):
    server = airflow_standalone
    max_steps = 1500
    run_id, path, proc = start_waiting(server, max_steps=max_steps)
    wait_for("a checkpoint and a few steps past it", lambda: steps_logged(path) >= 25, 180, 0.2)
    key = JobIdentity(SYNC_DAG, run_id, "train", 1).key
    # The ranks are held (SIGSTOP) from the kill until try 2 has adopted the job, so the job is
    # still running when try 2 looks, however fast this machine trains.
    with ranks_held(path):
        assert steps_logged(path) < max_steps
        set_paused(server, SYNC_DAG, True)
        try:
            proc.kill()  # a lost worker: no on_kill, no cancel
            ti = wait_try_ended(server, run_id)
            assert (ti["state"], ti["try_number"]) == ("up_for_retry", 1), ti
            assert exit_record(path) is None and job_processes(path)  # the job trains on
        finally:
            set_paused(server, SYNC_DAG, False)
        wait_for("try 2 to re-attach to the running job", lambda: f"Re-attaching to existing job {key}"
                 in try_log(server, SYNC_DAG, run_id, 2), 300, 1)
    assert wait_run_end(server, SYNC_DAG, run_id) == "success", server.tail()
    ti = server.ti(SYNC_DAG, run_id, "train")
    assert (ti["state"], ti["try_number"]) == ("success", 2), ti
    assert not job_dir(server.home, SYNC_DAG, run_id, 2).exists()  # no second job
    log = try_log(server, SYNC_DAG, run_id, 2)
    assert f"Try 1's job {key} is running: adopting it" in log, log[-3000:]
    assert f"Re-attaching to existing job {key}" in log
    record = exit_record(path)
    assert record["exit_code"] == 0 and record["cancelled"] is False
    assert steps_logged(path) == max_steps and not job_processes(path)
    steps = mlflow_steps(mlflow_server, run_id)
    assert len(steps) == len(set(steps)) and max(steps) == max_steps  # each step once


def test_retry_after_the_job_finished_goes_straight_to_its_outputs(airflow_standalone,
                                                                    mlflow_server):
    server = airflow_standalone
    max_steps = 1500
    run_id, path, proc = start_waiting(server, max_steps=max_steps)
    set_paused(server, SYNC_DAG, True)  # try 2 waits until the job has ended
    try:
        # The ranks are held (SIGSTOP) across the kill: the job is surely running when try 1
        # is killed, and finishes on its own only after that try has ended.
        with ranks_held(path):
            assert exit_record(path) is None, "the job ended before the kill: raise max_steps"
            proc.kill()
            ti = wait_try_ended(server, run_id)
            assert (ti["state"], ti["try_number"]) == ("up_for_retry", 1), ti
        record = wait_for("the job to finish on its own", lambda: exit_record(path), 600, 0.5)
        assert record["exit_code"] == 0 and record["cancelled"] is False
    finally:
        set_paused(server, SYNC_DAG, False)
    assert wait_run_end(server, SYNC_DAG, run_id) == "success", server.tail()
    ti = server.ti(SYNC_DAG, run_id, "train")
    assert (ti["state"], ti["try_number"]) == ("success", 2), ti
    for task in ("validate_checkpoint", "register_model"):
        assert server.ti(SYNC_DAG, run_id, task)["state"] == "success"
    assert not job_dir(server.home, SYNC_DAG, run_id, 2).exists()  # no new job
    key = JobIdentity(SYNC_DAG, run_id, "train", 1).key
    log = try_log(server, SYNC_DAG, run_id, 2)
    assert f"Try 1's job {key} is succeeded: adopting it" in log, log[-3000:]
    run = mlflow_run(mlflow_server, run_id)
    assert run.data.metrics["train/final_step"] == max_steps
    assert steps_logged(path) == max_steps


def test_execution_timeout_counts_from_the_first_start_across_the_deferral(airflow_standalone):
    server = airflow_standalone
    wait_for(f"the {DEADLINE_DAG} DAG", lambda: has_dag(server, DEADLINE_DAG), 120, 0.5)
    run_id = server.trigger(DEADLINE_DAG, {"max_steps": 200_000})
    path = job_dir(server.home, DEADLINE_DAG, run_id)
    wait_for("the train task to defer", lambda: server.ti(DEADLINE_DAG, run_id, "train")["state"]
             == "deferred" or None, 420, 1)
    assert wait_run_end(server, DEADLINE_DAG, run_id, 300) == "failed"
    ti = server.ti(DEADLINE_DAG, run_id, "train")
    assert (ti["state"], ti["try_number"]) == ("failed", 1), ti
    # start_date is the try's first start (kept across the deferral), end_date its failure.
    took_s = (dt.datetime.fromisoformat(ti["end_date"])
              - dt.datetime.fromisoformat(ti["start_date"])).total_seconds()
    # The trigger's deadline comes one poll (1 s) and a 5 s margin before the timeout; the end
    # adds the resume and the cancel. A clock reset at the resume would give a few seconds.
    assert DEADLINE_EXECUTION_TIMEOUT_S - 8 <= took_s <= DEADLINE_EXECUTION_TIMEOUT_S + 75, took_s
    record = wait_for("the job's exit record", lambda: exit_record(path), CANCEL_WITHIN_S)
    assert record["cancelled"] is True
    wait_for("no process of the job", lambda: not job_processes(path), 30)
    logs = airflow_logs(server, run_id, DEADLINE_DAG)
    assert "execution_timeout reached" in logs and "cancelling the job" in logs, logs[-3000:]
    assert server.ti(DEADLINE_DAG, run_id, "validate_checkpoint")["state"] in (
        "upstream_failed", None)
