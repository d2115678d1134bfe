"""The local engine: pure render (golden), and real torchrun jobs running a fake workload."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from trainforge.contract import FailureKind
from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.local.backend import LocalBackend

HERE = Path(__file__).resolve().parent
FAKES = HERE.parent  # fake_trainer.py, shared by the engines' tests
GOLDEN = HERE / "golden" / "local_render.json"


def _job(identity: JobIdentity, fake: dict, nproc: int = 2) -> TrainingJob:
    return TrainingJob(
        identity=identity,
        config={"fake": fake},
        module="fake_trainer",
        processes_per_node=nproc,
        env={"MLFLOW_RUN_ID": "abc"},
    )


def _wait(backend, handle, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = backend.status(handle)
        if status.state.terminal:
            return status
        time.sleep(0.2)
    raise AssertionError(f"job {handle['key']} did not end in {timeout_s} s")


def test_identity_key_is_deterministic_dns_safe_and_unique():
    a = JobIdentity("My_DAG", "manual__2026-01-01T00:00:00+00:00", "train", 1)
    assert a.key == JobIdentity("My_DAG", "manual__2026-01-01T00:00:00+00:00", "train", 1).key
    assert a.key != JobIdentity("My_DAG", "manual__2026-01-01T00:00:00+00:00", "train", 2).key
    assert a.key != JobIdentity("My-DAG", "manual__2026-01-01T00:00:00+00:00", "train", 1).key
    assert len(a.key) <= 63 and a.key == a.key.lower()
    assert all(c.isalnum() or c == "-" for c in a.key)


def test_render_is_pure_and_matches_golden():
    backend = LocalBackend(runs_root="/srv/trainforge/runs", python="/opt/venv/bin/python")
    identity = JobIdentity("shakespeare_llm", "manual__2026-01-01T00:00:00+00:00", "train", 1)
    job = TrainingJob(
        identity=identity,
        config={"format": "trainforge.job/v1"},
        processes_per_node=2,
        env={"MLFLOW_RUN_ID": "r1"},
        max_restarts=1,
    )
    rendered = backend.render(job)
    assert rendered == backend.render(job)
    assert not Path("/srv/trainforge").exists()
    if os.environ.get("TRAINFORGE_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(rendered, indent=2, sort_keys=True) + "\n")
    assert rendered == json.loads(GOLDEN.read_text())


def test_success_streams_logs_incrementally_and_reports_result(tmp_path):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKES))
    identity = JobIdentity("d", "r", "train", 1)
    handle = backend.submit(
        _job(identity, {"lines": 20, "line_sleep_s": 0.1, "result_status": "success"})
    )
    seen, offset, polls_with_lines = [], 0, 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        chunk = backend.read_logs(handle, offset)
        offset = chunk.next_offset
        seen += chunk.lines
        polls_with_lines += bool(chunk.lines)
        if backend.status(handle).state.terminal and not backend.read_logs(handle, offset).lines:
            break
        time.sleep(0.2)
    status = backend.status(handle)
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0
    assert status.result["final_step"] == 7
    rank0 = [line for line in seen if "rank0 line" in line]
    assert len(rank0) == 20
    assert not any("rank1 line" in line for line in seen)  # only rank 0 reaches the task log
    assert polls_with_lines > 1  # arrived in pieces while running, not one dump at the end
    assert (Path(handle["job_dir"]) / "ranks").is_dir()


@pytest.mark.parametrize(
    "result_status,kind",
    [
        ("bad_config", FailureKind.PERMANENT),
        ("diverged", FailureKind.PERMANENT),
        ("error", FailureKind.TRANSIENT),
        (None, FailureKind.TRANSIENT),
    ],
)
def test_failures_are_classified(tmp_path, result_status, kind):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKES))
    handle = backend.submit(
        _job(
            JobIdentity("d", "r", "train", 1),
            {"lines": 1, "exit_code": 3, "result_status": result_status, "message": "boom"},
            nproc=1,
        )
    )
    status = _wait(backend, handle)
    assert status.state is JobState.FAILED
    assert status.failure is kind


def test_submit_twice_and_find_reattach_without_a_second_job(tmp_path):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKES))
    identity = JobIdentity("d", "r", "train", 1)
    first = backend.submit(
        _job(identity, {"lines": 1, "sleep_s": 2, "result_status": "success"}, 1)
    )
    supervisor = json.loads((Path(first["job_dir"]) / "supervisor.json").read_text())
    again = backend.submit(_job(identity, {"lines": 1, "result_status": "success"}, 1))
    assert again == first == backend.find(identity)
    assert json.loads((Path(first["job_dir"]) / "supervisor.json").read_text()) == supervisor
    assert backend.find(JobIdentity("d", "r", "train", 2)) is None
    assert _wait(backend, first).state is JobState.SUCCEEDED


def test_cancel_stops_every_process_of_the_job(tmp_path):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKES))
    handle = backend.submit(_job(JobIdentity("d", "r", "train", 1), {"lines": 1, "sleep_s": 120}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "rank0 line 0" not in (
        Path(handle["job_dir"]) / "job.log"
    ).read_text(errors="replace"):
        time.sleep(0.2)
    pgid = json.loads((Path(handle["job_dir"]) / "supervisor.json").read_text())["pid"]
    root = psutil.Process(pgid)
    members = [root, *root.children(recursive=True)]
    assert len(members) >= 4  # supervisor, torchrun, two ranks
    status = backend.cancel(handle, grace_s=10)
    assert status.state is JobState.CANCELLED
    time.sleep(0.5)
    alive = [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left after cancel: {alive}"
    assert backend.cancel(handle).state is JobState.CANCELLED  # idempotent


def test_a_vanished_supervisor_is_a_transient_failure(tmp_path):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKES))
    handle = backend.submit(
        _job(JobIdentity("d", "r", "train", 1), {"lines": 1, "sleep_s": 120}, 1)
    )
    pid = json.loads((Path(handle["job_dir"]) / "supervisor.json").read_text())["pid"]
    time.sleep(1.0)
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and backend.status(handle).state is JobState.RUNNING:
        time.sleep(0.2)
    status = backend.status(handle)
    assert status.state is JobState.FAILED and status.failure is FailureKind.TRANSIENT
    assert "gone without an exit record" in status.message


def test_an_interrupted_run_cancels_only_its_own_pipelines_jobs(tmp_path):
    from trainforge.cli.runner import stop_local_jobs

    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKES))
    mine = backend.submit(_job(JobIdentity("mine", "r", "train", 1), {"lines": 1, "sleep_s": 120}, 1))
    other = backend.submit(_job(JobIdentity("other", "r", "train", 1), {"lines": 1, "sleep_s": 120}, 1))
    time.sleep(1.0)
    assert stop_local_jobs(tmp_path, "mine").cancelled == [mine["key"]]
    assert backend.status(mine).state is JobState.CANCELLED
    assert backend.status(other).state is JobState.RUNNING
    backend.cancel(other, grace_s=5)


def test_a_permanent_verdict_is_not_trained_again_by_torchrun_restarts(tmp_path):
    """The real trainer on 2 gloo ranks with max_restarts 2 and a batch that does not divide over
    2 ranks (exit 78 after the process group is up): the first attempt's verdict ends the job, its
    first rank at the verdict stopping torchrun's agent before any restart (trainer/verdict.py)."""
    from tests.trainer.conftest import make_job

    config = make_job(tmp_path / "no-dataset", tmp_path / "checkpoints",
                      optim={"global_batch_size": 6, "micro_batch_size": 2})  # 6 / (2 x 2) ranks
    backend = LocalBackend(tmp_path / "runs")
    job = TrainingJob(identity=JobIdentity("d", "r", "train", 1), config=config, processes_per_node=2,
                      max_restarts=2, env={"HF_HUB_OFFLINE": "1"})
    started = time.monotonic()
    status = _wait(backend, backend.submit(job), timeout_s=150)
    log = (Path(backend.job_dir(job.identity)) / "job.log").read_text()
    assert status.state is JobState.FAILED and status.failure is FailureKind.PERMANENT, log[-3000:]
    assert status.result["status"] == "bad_config" and "global_batch_size" in status.message, status
    assert log.count("process group up") == 1, log[-3000:]  # only the first attempt got as far as torch
    assert log.count("ConfigError (exit 78)") == 1, log[-3000:]  # rank 0's trainer ran once
    # the first rank at its verdict stopped torchrun's agent: torchrun did not restart the group
    assert "Received 15 death signal, shutting down workers" in log, log[-3000:]  # torchrun's own words
    assert "exiting without training" not in log and "failed (exitcode: 78)" not in log, log[-3000:]
    assert len(list(Path(backend.job_dir(job.identity)).glob("verdict.json.stop-*"))) == 1  # one SIGTERM
    print(f"job took {time.monotonic() - started:.1f} s")
