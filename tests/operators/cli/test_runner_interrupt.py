"""After Ctrl-C, `trainforge run` says which of the run's jobs were cancelled, and by whom.

Real local jobs (torchrun running the fake workload of tests/operators/engines/fake_trainer.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from trainforge.cli.runner import StoppedJobs, stop_local_jobs
from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.local.backend import LocalBackend

FAKE_DIR = Path(__file__).resolve().parents[1] / "engines"


def _submit(backend: LocalBackend, dag_id: str, run_id: str = "r") -> dict:
    return backend.submit(TrainingJob(identity=JobIdentity(dag_id, run_id, "train", 1),
                                      config={"fake": {"lines": 1, "sleep_s": 120}},
                                      module="fake_trainer", processes_per_node=1))


def test_a_job_its_task_already_cancelled_is_named_not_counted_as_zero(tmp_path):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKE_DIR))
    old = _submit(backend, "mine", "an-earlier-run")
    backend.cancel(old, grace_s=5)
    time.sleep(0.05)
    run_started = time.time()
    job = _submit(backend, "mine")
    time.sleep(1.0)
    # What the task's on_kill does when `airflow dags test` gets SIGTERM: cancel the job first.
    assert backend.cancel(job, grace_s=10).state is JobState.CANCELLED
    stopped = stop_local_jobs(tmp_path, "mine", since_epoch_s=run_started)
    assert stopped == StoppedJobs(cancelled=[], already_cancelled=[job["key"]])
    assert stopped.message() == (
        f"1 job(s) already cancelled by their task when Airflow stopped: {job['key']}")


def test_a_still_running_job_is_cancelled_and_named(tmp_path):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKE_DIR))
    run_started = time.time()
    job = _submit(backend, "mine")
    other = _submit(backend, "other")
    time.sleep(1.0)
    try:
        stopped = stop_local_jobs(tmp_path, "mine", since_epoch_s=run_started)
        assert stopped == StoppedJobs(cancelled=[job["key"]], already_cancelled=[])
        assert stopped.message() == f"Cancelled 1 running job(s): {job['key']}"
        assert backend.status(job).state is JobState.CANCELLED
        assert backend.status(other).state is JobState.RUNNING
    finally:
        backend.cancel(other, grace_s=5)


def test_no_job_at_all_is_said_plainly():
    assert StoppedJobs().message() == "No training job of this run was running."
