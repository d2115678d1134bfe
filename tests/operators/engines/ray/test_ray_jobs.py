"""The ray engine against a real Ray head on loopback (``ray start --head``): real torchrun jobs
running a fake workload, submitted through Ray's job API with this folder uploaded as the job's
``working_dir`` (as it would be to a remote cluster)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from trainforge.contract import FailureKind
from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.ray.backend import RayBackend
from trainforge.errors import JobNotFoundError

FAKES = Path(__file__).resolve().parents[1]  # fake_trainer.py

pytestmark = [pytest.mark.integration]


@pytest.fixture
def backend(ray_head) -> RayBackend:
    return RayBackend(address=ray_head.address)


def _job(identity: JobIdentity, fake: dict, nproc: int = 1, **options) -> TrainingJob:
    return TrainingJob(
        identity=identity,
        config={"fake": fake},
        module="fake_trainer",
        processes_per_node=nproc,
        env={"MLFLOW_RUN_ID": "abc"},
        engine_options={"working_dir": str(FAKES), **options},
        startup_timeout_s=120.0,
    )


def _wait(backend, handle, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = backend.status(handle)
        if status.state.terminal:
            return status
        time.sleep(0.3)
    raise AssertionError(f"Ray job {handle['submission_id']} did not end in {timeout_s} s")


def _job_processes(key: str) -> list[psutil.Process]:
    """Processes of one job: their command lines name its job folder ``trainforge-<key>.*``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(f"trainforge-{key}." in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_success_streams_logs_incrementally_and_reports_result(backend):
    identity = JobIdentity("d", "r-success", "train", 1)
    handle = backend.submit(
        _job(identity, {"lines": 20, "line_sleep_s": 0.2, "result_status": "success"}, nproc=2)
    )
    assert handle["submission_id"] == identity.key
    seen, offset, polls_with_lines, states = [], 0, 0, set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        chunk = backend.read_logs(handle, offset, max_bytes=4096)
        assert chunk.next_offset >= offset
        offset = chunk.next_offset
        seen += chunk.lines
        polls_with_lines += bool(chunk.lines)
        state = backend.status(handle).state
        states.add(state)
        if state.terminal and not backend.read_logs(handle, offset).lines:
            break
        time.sleep(0.3)
    status = backend.status(handle)
    assert status.state is JobState.SUCCEEDED, status.message
    assert status.exit_code == 0 and status.result["final_step"] == 7
    assert status.wall_s and status.wall_s > 0
    assert JobState.RUNNING in states
    rank0 = [line for line in seen if "rank0 line" in line]
    assert len(rank0) == 20
    assert not any("rank1 line" in line for line in seen)  # only rank 0 reaches the task log
    assert polls_with_lines > 1  # arrived in pieces while running, not one dump at the end
    assert len("\n".join(seen)) < offset + 1  # every byte read once


@pytest.mark.parametrize(
    "fake,kind,exit_code",
    [
        ({"exit_code": 78, "result_status": "bad_config", "message": "bad config"},
         FailureKind.PERMANENT, 78),
        ({"exit_code": 3}, FailureKind.TRANSIENT, 1),  # no result: torchrun's own exit code
    ],
    ids=["bad-config-78", "crash"],
)
def test_failures_are_classified(backend, fake, kind, exit_code):
    identity = JobIdentity("d", f"r-fail-{exit_code}", "train", 1)
    status = _wait(backend, backend.submit(_job(identity, {"lines": 1, **fake})))
    assert status.state is JobState.FAILED
    assert status.failure is kind
    assert status.exit_code == exit_code
    assert status.message.startswith(f"Ray job {identity.key} failed")
    if kind is FailureKind.PERMANENT:
        assert "bad config" in status.message and status.result["status"] == "bad_config"


def test_retry_adopts_running_skips_succeeded_and_resubmits_failed(backend, ray_head):
    # A running job is adopted: same submission, no second job.
    running = JobIdentity("d", "r-adopt", "train", 1)
    first = backend.submit(_job(running, {"lines": 1, "sleep_s": 3, "result_status": "success"}))
    again = backend.submit(_job(running, {"lines": 1, "result_status": "success"}))
    assert again["submission_id"] == first["submission_id"] == running.key
    assert backend.find(running)["submission_id"] == running.key
    assert backend.find(JobIdentity("d", "r-adopt", "train", 2)) is None
    assert _wait(backend, first).state is JobState.SUCCEEDED
    # A succeeded job is not run again.
    assert backend.submit(_job(running, {"lines": 1}))["submission_id"] == running.key
    # A failed job is submitted again with a suffixed id; find() then returns the new one.
    failing = JobIdentity("d", "r-resubmit", "train", 1)
    failed = backend.submit(_job(failing, {"lines": 1, "exit_code": 3}))
    assert _wait(backend, failed).state is JobState.FAILED
    retried = backend.submit(_job(failing, {"lines": 1, "result_status": "success"}))
    assert retried["submission_id"] == f"{failing.key}-r2"
    assert backend.find(failing)["submission_id"] == f"{failing.key}-r2"
    assert _wait(backend, retried).state is JobState.SUCCEEDED
    ids = {job.submission_id for job in backend._client().list_jobs()}
    assert f"{running.key}-r2" not in ids and f"{failing.key}-r3" not in ids


def test_cancel_stops_the_job_and_every_process(backend):
    identity = JobIdentity("d", "r-cancel", "train", 1)
    handle = backend.submit(_job(identity, {"lines": 1, "sleep_s": 300}, nproc=2))
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline and "rank0 line 0" not in text:
        text += "\n".join(backend.read_logs(handle, len(text.encode())).lines) + "\n"
        time.sleep(0.3)
    members = _job_processes(identity.key)
    assert len(members) >= 3, members  # torchrun and two ranks (and the entrypoint's sh)
    status = backend.cancel(handle, grace_s=30)
    assert status.state is JobState.CANCELLED
    time.sleep(0.5)
    alive = [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left after cancel: {alive}"
    assert backend.cancel(handle).state is JobState.CANCELLED  # idempotent


def test_pending_beyond_the_startup_timeout_fails_with_rays_reason_and_never_runs(backend):
    # A running job holds both CPUs of the head, so the next one stays PENDING.
    blocker = backend.submit(_job(JobIdentity("d", "r-blocker", "train", 1),
                                  {"lines": 1, "sleep_s": 300}, nproc=2))
    deadline = time.monotonic() + 60
    while backend.status(blocker).state is not JobState.RUNNING:
        assert time.monotonic() < deadline, "the blocking job did not start"
        time.sleep(0.3)
    identity = JobIdentity("d", "r-pending", "train", 1)
    handle = backend.submit(
        replace(_job(identity, {"lines": 3}, nproc=2), startup_timeout_s=4.0))
    assert backend.status(handle).state is JobState.PENDING
    status = _wait(backend, handle, timeout_s=60)
    assert status.state is JobState.FAILED and status.failure is FailureKind.TRANSIENT
    assert "did not start within the startup timeout (4 s)" in status.message
    assert "waiting for resources" in status.message and "2 CPU, 0 GPU" in status.message
    assert "a stop request is queued" in status.message
    # Once the CPUs are free, the queued stop ends the job before its entrypoint runs.
    assert backend.cancel(blocker, grace_s=30).state is JobState.CANCELLED
    deadline = time.monotonic() + 60
    while str(backend._client().get_job_status(identity.key)) != "STOPPED":
        assert time.monotonic() < deadline, "the timed-out job was not stopped"
        time.sleep(0.3)
    assert "rank0 line" not in backend._client().get_job_logs(identity.key)
    assert backend.status(handle).state is JobState.CANCELLED
    # find() rebuilds the same startup deadline from the job's metadata
    assert backend.find(identity)["startup_deadline_epoch_s"] == pytest.approx(
        handle["startup_deadline_epoch_s"], abs=2.0)


def test_cancel_of_a_job_that_never_started_says_so(backend):
    identity = JobIdentity("d", "r-no-gpu", "train", 1)
    handle = backend.submit(_job(identity, {"lines": 1}, entrypoint_num_gpus=1.0))  # no GPU here
    status = backend.cancel(handle, grace_s=2)
    assert status.state is JobState.CANCELLED and "never started" in status.message


def test_an_unknown_job_is_not_found(backend):
    with pytest.raises(JobNotFoundError, match="not found"):
        backend.status({"submission_id": "no-such-job", "key": "no-such-job"})
