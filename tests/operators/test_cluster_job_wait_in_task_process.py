"""Waiting in the worker slot (``fault.deferrable: false``): the trigger's coroutine run in the
task process, and what a SIGTERM or Airflow's execution timeout does to that wait.

Real local jobs (the backend tests' stand-in workload) and a real MLflow server; the signals are
real signals to this process, delivered while the wait runs. The whole path under a real
``airflow standalone`` is in tests/faults/test_airflow_task_kill.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.local.backend import LocalBackend
from trainforge.pipeline.loader import load_spec
from trainforge.cluster_job import TaskProcessTerminated
from trainforge.tasks.train import TrainOperator
from trainforge.triggers import TrainingJobTrigger

FAKE_DIR = Path(__file__).resolve().parent / "engines"
FAULT_SPEC = Path(__file__).resolve().parents[1] / "faults" / "fault_tiny.yaml"


def _text(records) -> str:
    return "\n".join(str(r.get("event")) % tuple(r.get("positional_args") or ())
                     for r in records)


def _submit(tmp_path, fake):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKE_DIR))
    handle = backend.submit(TrainingJob(identity=JobIdentity("d", "r", "train", 1),
                                        config={"fake": fake}, module="fake_trainer"))
    return backend, handle


def _trigger(tmp_path, handle, cancel_on_kill=True, deadline=None):
    return TrainingJobTrigger(engine="local", backend_kwargs={"runs_root": str(tmp_path / "runs")},
                              handle=handle, poll_interval_s=0.5, cancel_on_kill=cancel_on_kill,
                              cancel_grace_s=5, deadline_epoch_s=deadline)


def test_wait_here_gives_the_triggerers_event_and_logs(tmp_path):
    from structlog.testing import capture_logs

    _, handle = _submit(tmp_path, {"lines": 4, "line_sleep_s": 0.2, "result_status": "success"})
    with capture_logs() as records:
        event = _trigger(tmp_path, handle).wait_here()
    assert event["status"] == "success" and event["result"]["final_step"] == 7
    assert event["job"] == {"dag_id": "d", "run_id": "r", "task_id": "train", "try_number": 1}
    assert _text(records).count("rank0 line") == 4


@pytest.fixture
def killable(tmp_path, monkeypatch, mlflow_server):
    """An operator waiting on a real two-minute local job, its MLflow run, and a count of the
    engine cancels it makes (the real cancel, counted)."""
    import mlflow

    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    client = mlflow.MlflowClient(mlflow_server)
    run_id = client.create_run(client.create_experiment(f"wait-{time.time_ns()}")).info.run_id
    backend, handle = _submit(tmp_path, {"lines": 1, "sleep_s": 120})
    cancels: list[str] = []
    real_cancel = LocalBackend.cancel

    def counted_cancel(self, job, grace_s=30.0):
        cancels.append(job["key"])
        return real_cancel(self, job, grace_s)

    monkeypatch.setattr(LocalBackend, "cancel", counted_cancel)

    def make(cancel_on_kill=True):
        data = load_spec(FAULT_SPEC).model_dump(mode="json")
        data["training"]["fault"].update(deferrable=False, cancel_on_kill=cancel_on_kill)
        op = TrainOperator(task_id="train", spec=data, mlflow_tracking_uri=mlflow_server)
        op._handle, op._mlflow_run_id = handle, run_id
        return op, _trigger(tmp_path, handle, cancel_on_kill)

    yield make, backend, handle, client, run_id, cancels
    real_cancel(backend, handle, 5)


def _sigterm_after(delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def test_sigterm_during_the_wait_cancels_once_ends_the_run_killed_and_fails(killable):
    from structlog.testing import capture_logs

    make, backend, handle, client, run_id, cancels = killable
    op, trigger = make()
    calls = []

    def task_sdk_handler(signum, frame):  # what Airflow's task runner installs: on_kill()
        calls.append(signum)
        op.on_kill()

    previous = signal.signal(signal.SIGTERM, task_sdk_handler)
    try:
        _sigterm_after(1.5)
        with capture_logs() as records, pytest.raises(TaskProcessTerminated, match="cancelled"):
            op._wait_in_task_process(trigger)
        assert signal.getsignal(signal.SIGTERM) is task_sdk_handler  # restored after the wait
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == [signal.SIGTERM]  # Airflow's handler still ran
    assert backend.status(handle).state == JobState.CANCELLED
    assert cancels == [handle["key"]]  # exactly once, by on_kill
    assert client.get_run(run_id).info.status == "KILLED"
    text = _text(records)
    assert "Task killed: cancelling job" in text
    # The trigger's own cancel-on-kill path kept quiet: on_kill decided.
    assert "in the task process stopped" in text and "while deferred" not in text


def test_sigterm_with_cancel_on_kill_false_ends_the_wait_and_keeps_the_job(killable):
    make, backend, handle, client, run_id, cancels = killable
    op, trigger = make(cancel_on_kill=False)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # no handler before: on_kill alone
    try:
        _sigterm_after(1.5)
        with pytest.raises(TaskProcessTerminated, match="not cancelled"):
            op._wait_in_task_process(trigger)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert backend.status(handle).state == JobState.RUNNING and cancels == []
    assert client.get_run(run_id).info.status == "RUNNING"


def test_airflows_execution_timeout_ends_the_wait_and_on_kill_cancels_once(killable):
    from airflow.sdk.exceptions import AirflowTaskTimeout
    from airflow.sdk.execution_time.timeout import timeout

    make, backend, handle, client, run_id, cancels = killable
    op, trigger = make()
    started = time.monotonic()
    # What Airflow's task runner does around execute(): SIGALRM, then on_kill() on the timeout.
    with pytest.raises(AirflowTaskTimeout):
        try:
            with timeout(2):
                op._wait_in_task_process(trigger)
        except AirflowTaskTimeout:
            op.on_kill()
            raise
    assert time.monotonic() - started < 60
    assert backend.status(handle).state == JobState.CANCELLED
    assert cancels == [handle["key"]]
    assert client.get_run(run_id).info.status == "KILLED"


def test_timeout_event_cancels_and_the_runners_on_kill_does_not_cancel_again(killable):
    from airflow.sdk.exceptions import AirflowTaskTimeout

    make, backend, handle, client, run_id, cancels = killable
    op, _ = make()
    event = {"status": "timeout", "message": "job k still running at its deadline "
             "(execution_timeout reached)", "handle": handle, "job": handle["identity"],
             "deadline_reason": "execution_timeout"}
    with pytest.raises(AirflowTaskTimeout, match="execution_timeout"):
        try:
            op.execute_complete({"params": {}}, event)
        except AirflowTaskTimeout:
            op.on_kill()  # the task runner's reaction to AirflowTaskTimeout
            raise
    assert backend.status(handle).state == JobState.CANCELLED
    assert cancels == [handle["key"]]
    assert client.get_run(run_id).info.status == "KILLED"
