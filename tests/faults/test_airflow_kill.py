"""Faults from Airflow's side, under a real ``airflow standalone`` (scheduler, triggerer, API).

The pipeline is the real one (data prep, torchrun training on the local engine, MLflow server on
loopback); the trigger is loaded by Airflow's own triggerer process from the installed package.

* mark failed / mark success / clear while the train task is deferred: the job is cancelled
  within the grace period and the trigger's log says so; no training process is left.
* triggerer restart mid-run: the job keeps running, no second job is submitted, and the run
  finishes with the task successful at the planned final step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest
from faultlib import (
    CANCEL_WITHIN_S,
    airflow_logs,
    exit_record,
    has_dag,
    job_processes,
    mlflow_steps,
    steps_logged,
    wait_for,
)

from trainforge.engines.base import JobIdentity

pytestmark = [pytest.mark.airflow, pytest.mark.integration]

DAG = "fault_tiny"


def job_dir(home: Path, run_id: str, try_number: int = 1) -> Path:
    return home / "runs" / JobIdentity(DAG, run_id, "train", try_number).key


def start_training(server, max_steps: int) -> tuple[str, Path]:
    """Trigger a run; return once its train task is deferred and rank 0 logs steps."""
    run_id = server.trigger(DAG, {"max_steps": max_steps})
    path = job_dir(server.home, run_id)
    wait_for("the train task to defer", lambda: server.ti(DAG, run_id, "train")["state"]
             == "deferred" or None, 300, 0.5)
    wait_for("rank 0's first step line", lambda: steps_logged(path), 180, 1)
    return run_id, path


# success takes the same way out as failed (a state set from outside, the trigger cancelled):
# a second route, in the heavy tier.
@pytest.mark.parametrize("action", ["failed", pytest.param("success", marks=pytest.mark.heavy), "clear"])
def test_user_action_while_deferred_cancels_the_job(airflow_standalone, action):
    server = airflow_standalone
    run_id, path = start_training(server, max_steps=200_000)
    assert exit_record(path) is None and job_processes(path)
    if action == "clear":
        server.clear(DAG, run_id, "train")
        _cleared_task_waits_on_exactly_one_job(server, run_id, path)
        return
    server.set_state(DAG, run_id, "train", action)
    record = wait_for("the job to be cancelled", lambda: exit_record(path), CANCEL_WITHIN_S)
    assert record["cancelled"] is True
    wait_for("no process of the job", lambda: not job_processes(path), 30)
    key = JobIdentity(DAG, run_id, "train", 1).key
    logs = airflow_logs(server, run_id, DAG)
    assert f"cancelling job {key}" in logs, logs[-3000:]
    if action == "failed":
        # Downstream never runs on a killed training.
        wait_for("the run to end", lambda: server.run_state(DAG, run_id) == "failed", 120, 0.5)
        assert server.ti(DAG, run_id, "validate_checkpoint")["state"] in ("upstream_failed", None)


def _cleared_task_waits_on_exactly_one_job(server, run_id: str, first: Path) -> None:
    """After a clear, try 2 waits on one live job: its own resuming job (try 1's cancelled), or
    try 1's job adopted when the trigger still saw the task deferred. Never two."""
    second = job_dir(server.home, run_id, 2)
    wait_for("try 2 to defer", lambda: (lambda ti: ti["try_number"] == 2
                                        and ti["state"] == "deferred")(
        server.ti(DAG, run_id, "train")), 300, 0.5)
    time.sleep(CANCEL_WITHIN_S / 3)  # let a cancellation in flight land
    live = [p for p in (first, second) if job_processes(p)]
    assert len(live) == 1, live
    if live == [second]:
        assert exit_record(first)["cancelled"] is True
    else:
        assert not second.exists()  # adopted: no second job was ever submitted
    server.set_state(DAG, run_id, "train", "failed")
    wait_for("the live job to be cancelled", lambda: exit_record(live[0]), CANCEL_WITHIN_S)
    wait_for("no process of the job", lambda: not job_processes(live[0]), 30)


@pytest.mark.heavy
def test_triggerer_restart_keeps_the_job_and_the_run_finishes(airflow_standalone):
    server = airflow_standalone
    max_steps = 1500
    run_id, path = start_training(server, max_steps=max_steps)
    server.restart_triggerer()
    # The new triggerer picks the trigger up again; the job was never interrupted.
    wait_for("the run to end", lambda: server.run_state(DAG, run_id) in ("success", "failed")
             and server.run_state(DAG, run_id), 900, 0.5)
    record = exit_record(path)
    assert record is not None and record["cancelled"] is False and record["exit_code"] == 0
    assert server.ti(DAG, run_id, "train")["state"] == "success", server.tail()
    assert server.ti(DAG, run_id, "train")["try_number"] == 1
    assert steps_logged(path) == max_steps
    assert not (job_dir(server.home, run_id, 2)).exists()  # no second job
    assert "cancelling job" not in airflow_logs(server, run_id, DAG)
    assert not job_processes(path)


def rank_processes(path: Path) -> list[psutil.Process]:
    return [p for p in job_processes(path) if "trainforge.trainer.train" in p.cmdline()
            and "torch.distributed.run" not in p.cmdline()]


@pytest.mark.heavy
@pytest.mark.distributed
def test_worker_sigkill_mid_step_is_restarted_by_torchrun_and_resumes(airflow_standalone,
                                                                        mlflow_server):
    server = airflow_standalone
    max_steps = 600
    run_id, path = start_training(server, max_steps=max_steps)
    wait_for("a checkpoint and a few steps past it", lambda: steps_logged(path) >= 25, 180, 0.2)
    victims = rank_processes(path)
    assert victims
    for proc in victims:
        proc.kill()
    wait_for("the run to end", lambda: server.run_state(DAG, run_id) in ("success", "failed")
             and server.run_state(DAG, run_id), 900, 0.5)
    assert server.ti(DAG, run_id, "train")["state"] == "success", server.tail()
    assert server.ti(DAG, run_id, "train")["try_number"] == 1  # the engine restarted, not Airflow
    text = (path / "job.log").read_text(errors="replace")
    assert "resuming from" in text and steps_logged(path) == max_steps
    assert exit_record(path)["exit_code"] == 0
    assert not job_processes(path)
    steps = mlflow_steps(mlflow_server, run_id)
    assert len(steps) == len(set(steps)) and max(steps) == max_steps  # each step once


@pytest.mark.heavy
def test_lost_job_is_retried_by_a_new_job_that_resumes(airflow_standalone, mlflow_server):
    server = airflow_standalone
    max_steps = 600
    run_id, first = start_training(server, max_steps=max_steps)
    wait_for("a checkpoint and a few steps past it", lambda: steps_logged(first) >= 25, 180, 0.2)
    for proc in job_processes(first):  # the whole job: supervisor, torchrun and ranks
        proc.kill()
    second = job_dir(server.home, run_id, 2)
    wait_for("try 2's job", lambda: (second / "request.json").exists(), 300, 0.5)
    assert not job_processes(first)  # never two live jobs for one task
    wait_for("the run to end", lambda: server.run_state(DAG, run_id) in ("success", "failed")
             and server.run_state(DAG, run_id), 900, 0.5)
    ti = server.ti(DAG, run_id, "train")
    assert (ti["state"], ti["try_number"]) == ("success", 2), server.tail()
    text = (second / "job.log").read_text(errors="replace")
    assert "resuming from" in text and steps_logged(second) == max_steps
    assert not job_processes(second)
    steps = mlflow_steps(mlflow_server, run_id)
    assert len(steps) == len(set(steps)) and max(steps) == max_steps


def test_diverged_loss_fails_at_once_without_retry(airflow_standalone, mlflow_server):
    from mlflow import MlflowClient

    server, dag = airflow_standalone, "fault_diverge"
    wait_for("the fault_diverge DAG", lambda: has_dag(server, dag), 120, 0.5)
    run_id = server.trigger(dag)
    wait_for("the run to end", lambda: server.run_state(dag, run_id) in ("success", "failed")
             and server.run_state(dag, run_id), 900, 0.5)
    ti = server.ti(dag, run_id, "train")
    # retries: 1 in the spec, yet one try: exit 79 is permanent.
    assert (ti["state"], ti["try_number"]) == ("failed", 1), ti
    assert server.ti(dag, run_id, "validate_checkpoint")["state"] in ("upstream_failed", None)
    path = server.home / "runs" / JobIdentity(dag, run_id, "train", 1).key
    assert exit_record(path)["exit_code"] != 0
    result = json.loads((path / "result.json").read_text())
    assert result["status"] == "diverged" and result["exit_code"] == 79
    # No checkpoint of the diverged step is valid: the newest valid one is of the last step
    # completed before it (final_step; the diverged one is final_step + 1), and it is the one
    # the result names.
    from trainforge.trainer import checkpoint as ckpt

    assert result["last_checkpoint"], result
    newest = ckpt.newest_valid(Path(result["last_checkpoint"]).parent)
    assert newest is not None and int(newest.name.split("-")[1]) <= result["final_step"]
    assert str(newest) == result["last_checkpoint"]
    assert f"no checkpoint written after step {result['final_step']}" in result["message"]
    assert not (server.home / "runs" / JobIdentity(dag, run_id, "train", 2).key).exists()
    client = MlflowClient(mlflow_server)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              f"tags.`trainforge.airflow_run_id` = '{run_id}'")
    assert [r.info.status for r in runs] == ["FAILED"]  # no run left RUNNING
    assert not job_processes(path)


def test_bad_trigger_parameters_fail_the_run_before_any_job(airflow_standalone):
    server = airflow_standalone
    run_id = server.trigger(DAG, {"micro_batch_size": 3})  # 4 is not a multiple of 3 x 1
    wait_for("the run to end", lambda: server.run_state(DAG, run_id) in ("success", "failed")
             and server.run_state(DAG, run_id), 300, 0.5)
    prepare = server.ti(DAG, run_id, "prepare_data")
    assert (prepare["state"], prepare["try_number"]) == ("failed", 1)
    assert server.ti(DAG, run_id, "train")["state"] in ("upstream_failed", None)
    assert not job_dir(server.home, run_id).exists()  # nothing was launched
    assert "global_batch_size must be divisible by micro_batch_size" in airflow_logs(
        server, run_id, DAG)


