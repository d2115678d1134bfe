"""The slurm engine against a real one-node Slurm cluster (slurmctld + slurmd + munged, started
by the ``slurm_cluster`` fixture), running a fake workload under real srun and torchrun."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainforge.contract import FailureKind
from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.slurm.backend import SlurmBackend
from trainforge.errors import BackendError
from tests.slurm_cluster import slurm_cluster  # noqa: F401 - the session's Slurm cluster

pytestmark = pytest.mark.integration

FAKES = Path(__file__).resolve().parents[1]  # fake_trainer.py


def _job(identity: JobIdentity, fake: dict, nproc: int = 1, **kwargs) -> TrainingJob:
    options = {"python": sys.executable, "working_dir": str(FAKES),
               **kwargs.pop("engine_options", {})}
    return TrainingJob(
        identity=identity,
        config={"fake": fake},
        module="fake_trainer",
        processes_per_node=nproc,
        env={"MLFLOW_RUN_ID": "abc"},
        engine_options=options,
        max_runtime_s=kwargs.pop("max_runtime_s", 600.0),
        **kwargs,
    )


@pytest.fixture
def backend(slurm_cluster, tmp_path):  # noqa: F811 - the fixture imported above
    return SlurmBackend(tmp_path / "runs")


def _wait(backend, handle, until=lambda s: s.state.terminal, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = backend.status(handle)
        if until(status):
            return status
        time.sleep(0.3)
    raise AssertionError(f"Slurm job {handle['job_id']} did not reach the expected state in "
                         f"{timeout_s} s (last: {status})")


def _squeue_state(cluster, job_id: str) -> str:
    return cluster.run("squeue", "-j", job_id, "--states=all", "-h", "-o", "%T").stdout.strip()


def _workers(job_dir: str) -> list:
    """Live processes of the fake workload of the job in ``job_dir``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if f"{job_dir}/job.json" in cmdline:
            found.append(proc)
    return found


def test_success_streams_logs_incrementally_and_reports_result(backend, slurm_cluster):
    handle = backend.submit(_job(JobIdentity("d", "r", "train", 1),
                                 {"lines": 12, "line_sleep_s": 0.25, "result_status": "success"},
                                 nproc=2))
    assert handle["job_id"].isdigit()
    sbatch = (Path(handle["job_dir"]) / "job.sbatch").read_text()
    assert sbatch == backend.render(_job(JobIdentity("d", "r", "train", 1), {
        "lines": 12, "line_sleep_s": 0.25, "result_status": "success"}, nproc=2))["script"]
    seen, offset, polls_with_lines, states = [], 0, 0, set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        chunk = backend.read_logs(handle, offset)
        offset = chunk.next_offset
        seen += chunk.lines
        polls_with_lines += bool(chunk.lines)
        state = backend.status(handle).state
        states.add(state)
        if state.terminal and not backend.read_logs(handle, offset).lines:
            break
        time.sleep(0.3)
    status = backend.status(handle)
    assert status.state is JobState.SUCCEEDED, (status, "\n".join(seen))
    assert status.exit_code == 0 and status.result["final_step"] == 7
    assert status.wall_s is not None and status.wall_s >= 0
    assert JobState.RUNNING in states
    assert len([line for line in seen if "rank0 line" in line]) == 12
    assert not any("rank1 line" in line for line in seen)  # rank 0 only in the task log
    assert any(f"Slurm job {handle['job_id']} on localhost" in line for line in seen)
    assert polls_with_lines > 1  # arrived while running, not in one piece at the end
    assert _squeue_state(slurm_cluster, handle["job_id"]) == "COMPLETED"
    job = slurm_cluster.run("scontrol", "show", "job", "-o", handle["job_id"]).stdout
    assert "JobName=d-train-t1-" in job and "NumCPUs=2" in job and "Requeue=0" in job
    assert "run_id=r task_id=train try=1" in job  # the comment carries the identity


@pytest.mark.parametrize("fake,kind", [
    ({"exit_code": 78, "result_status": "bad_config", "message": "bad lr"}, FailureKind.PERMANENT),
    ({"exit_code": 3, "result_status": "error", "message": "boom"}, FailureKind.TRANSIENT),
], ids=["exit-78-permanent", "exit-3-transient"])
def test_failures_are_classified(backend, fake, kind):
    handle = backend.submit(_job(JobIdentity("d", "r", "train", 1), {"lines": 1, **fake}))
    status = _wait(backend, handle)
    assert status.state is JobState.FAILED and status.failure is kind
    assert fake["message"] in status.message and f"Slurm job {handle['job_id']}" in status.message


def test_cancel_stops_a_running_job_and_is_idempotent(backend, slurm_cluster, caplog):
    handle = backend.submit(_job(JobIdentity("d", "r", "train", 1),
                                 {"lines": 1, "sleep_s": 300}))
    _wait(backend, handle, until=lambda s: s.state is JobState.RUNNING)
    _wait(backend, handle, until=lambda s: bool(_workers(handle["job_dir"])), timeout_s=60)
    with caplog.at_level(logging.INFO, logger="trainforge.engines.slurm"):
        status = backend.cancel(handle, grace_s=30)
    assert status.state is JobState.CANCELLED, status
    # SIGTERM reached torchrun through srun and the script went on to record the exit: the
    # polite stop worked within the grace period, no forced scancel was needed.
    said = [r.getMessage() for r in caplog.records]
    assert any("SIGTERM, 30 s grace" in m for m in said), said
    assert not any("after SIGTERM: scancel" in m for m in said), said
    assert (Path(handle["job_dir"]) / "exit.json").exists()
    assert backend.cancel(handle).state is JobState.CANCELLED
    assert json.loads((Path(handle["job_dir"]) / "cancel.json").read_text())["requested_at"]
    psutil.wait_procs(_workers(handle["job_dir"]), timeout=15)
    assert not _workers(handle["job_dir"])


def test_submit_twice_and_find_adopt_the_same_job(backend, slurm_cluster, tmp_path):
    identity = JobIdentity("d", "r", "train", 1)
    job = _job(identity, {"lines": 1, "sleep_s": 300})
    first = backend.submit(job)
    assert backend.submit(job)["job_id"] == first["job_id"]
    # A fresh backend (a retry in another worker) finds it through the job folder's record.
    other = SlurmBackend(tmp_path / "runs")
    assert other.find(identity)["job_id"] == first["job_id"]
    assert other.find(JobIdentity("d", "r", "train", 2)) is None
    # sbatch accepted the job but its answer was lost: found by job name (squeue --name).
    (Path(first["job_dir"]) / "slurm_job.json").unlink()
    found = other.find(identity)
    assert found["job_id"] == first["job_id"]
    assert found["submitted_at_epoch_s"] == pytest.approx(first["submitted_at_epoch_s"], abs=5)
    assert other.submit(job)["job_id"] == first["job_id"]
    assert backend.cancel(first, grace_s=5).state is JobState.CANCELLED


def test_pending_beyond_startup_timeout_is_cancelled_with_slurms_reason(backend, slurm_cluster):
    # A job holding every CPU of the node keeps ours pending for "Resources".
    filler = slurm_cluster.run("sbatch", "--parsable", "--cpus-per-task=2", "--job-name=filler",
                               "--output=/dev/null", "--wrap=sleep 300").stdout.strip()
    try:
        deadline = time.monotonic() + 30
        while _squeue_state(slurm_cluster, filler) != "RUNNING":
            assert time.monotonic() < deadline, "the filler job did not start"
            time.sleep(0.3)
        handle = backend.submit(_job(JobIdentity("d", "r", "train", 1), {"lines": 1},
                                     nproc=2, startup_timeout_s=4.0))
        pending = _wait(backend, handle, until=lambda s: "Resources" in s.message
                        or s.state is not JobState.PENDING, timeout_s=30)
        assert pending.state is JobState.PENDING and "waiting for nodes" in pending.message
        failed = _wait(backend, handle, timeout_s=30)
        assert failed.state is JobState.FAILED and failed.failure is FailureKind.TRANSIENT
        assert "did not start within the startup timeout (4 s)" in failed.message
        assert "Resources" in failed.message
        deadline = time.monotonic() + 15
        while _squeue_state(slurm_cluster, handle["job_id"]) != "CANCELLED":
            assert time.monotonic() < deadline, "the late job was not cancelled in Slurm"
            time.sleep(0.3)
        again = backend.status(handle)  # Slurm says CANCELLED; for us it failed to start
        assert (again.state, again.failure, again.message) == (
            JobState.FAILED, FailureKind.TRANSIENT, failed.message)
    finally:
        slurm_cluster.run("scancel", filler)


def test_a_job_that_can_never_start_fails_permanently_at_once(backend, slurm_cluster):
    # Partition 'short' allows 1 minute; the job asks for 10 (fault.run_timeout).
    handle = backend.submit(_job(JobIdentity("d", "r", "train", 1), {"lines": 1},
                                 engine_options={"partition": "short"}, max_runtime_s=600.0,
                                 startup_timeout_s=600.0))
    status = _wait(backend, handle, until=lambda s: s.state is not JobState.PENDING,
                   timeout_s=30)
    assert status.state is JobState.FAILED and status.failure is FailureKind.PERMANENT
    assert "PartitionTimeLimit" in status.message and "can never start" in status.message
    deadline = time.monotonic() + 15
    while _squeue_state(slurm_cluster, handle["job_id"]) != "CANCELLED":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert backend.status(handle).failure is FailureKind.PERMANENT


def test_sbatch_refusal_is_one_clear_error_and_leaves_no_job(backend, slurm_cluster):
    job = _job(JobIdentity("d", "r", "train", 1), {"lines": 1},
               engine_options={"partition": "nope"})
    with pytest.raises(BackendError, match=r"sbatch refused Slurm job d-train-t1-.*[Pp]artition"):
        backend.submit(job)
    assert backend.find(job.identity) is None
    assert not slurm_cluster.run("squeue", "-h", "--name", job.identity.key).stdout.strip()


@pytest.mark.parametrize("exit_record,result,state,kind", [
    ({"exit_code": 0}, {"status": "success", "final_step": 7}, JobState.SUCCEEDED, None),
    ({"exit_code": 1}, {"status": "diverged", "message": "loss is nan"}, JobState.FAILED,
     FailureKind.PERMANENT),
    (None, None, JobState.FAILED, FailureKind.TRANSIENT),
], ids=["exit-0", "diverged", "no-record"])
def test_a_job_slurm_has_forgotten_is_judged_by_its_exit_record(
        backend, tmp_path, exit_record, result, state, kind):
    # No accounting on this cluster and job 987654 is unknown to the controller: only the
    # job folder on shared storage can tell how it ended.
    job_dir = tmp_path / "runs" / "gone"
    job_dir.mkdir(parents=True)
    (job_dir / "request.json").write_text("{}")
    if exit_record is not None:
        (job_dir / "exit.json").write_text(json.dumps(exit_record))
    if result is not None:
        (job_dir / "result.json").write_text(json.dumps(result))
    status = backend.status({"job_id": "987654", "job_dir": str(job_dir), "key": "gone"})
    assert status.state is state and status.failure is kind
    if exit_record is None:
        assert "no longer known to Slurm" in status.message


@pytest.mark.distributed
def test_the_real_trainer_trains_under_srun_and_torchrun(backend, tmp_path):
    from tests.trainer.conftest import build_dataset, make_job

    dataset = build_dataset(tmp_path / "dataset")
    config = make_job(dataset, tmp_path / "checkpoints",
                      optim={"max_steps": 6, "global_batch_size": 8, "micro_batch_size": 2,
                             "warmup_steps": 1},
                      checkpoint={"interval_steps": 3, "keep_last": 2})
    job = TrainingJob(identity=JobIdentity("tiny", "manual__1", "train", 1), config=config,
                      processes_per_node=2, max_runtime_s=600.0,
                      engine_options={"python": sys.executable,
                                      "working_dir": str(FAKES.parents[2])})
    handle = backend.submit(job)
    status = _wait(backend, handle, timeout_s=300)
    log = (Path(handle["job_dir"]) / "job.log").read_text()
    assert status.state is JobState.SUCCEEDED, (status, log[-3000:])
    assert status.result["final_step"] == 6
    assert (tmp_path / "checkpoints" / "step-00000006" / "manifest.json").is_file()
    assert "rendezvous 127.0.0.1:" in log


STUBBORN = """\
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a workload that ignores the polite stop
print("stubborn started", flush=True)
time.sleep(300)
"""


def test_cancel_escalates_when_the_workload_ignores_sigterm(backend, slurm_cluster, tmp_path):
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    job = TrainingJob(identity=JobIdentity("d", "r", "train", 1), config={}, module="stubborn",
                      max_runtime_s=600.0,
                      engine_options={"python": sys.executable, "working_dir": str(tmp_path)})
    handle = backend.submit(job)
    _wait(backend, handle, until=lambda s: "stubborn started" in "\n".join(
        backend.read_logs(handle, 0).lines), timeout_s=60)
    assert _workers(handle["job_dir"])
    started = time.monotonic()
    status = backend.cancel(handle, grace_s=3)
    elapsed = time.monotonic() - started
    assert status.state is JobState.CANCELLED, status
    # SIGTERM was ignored for the 3 s grace; then scancel ended it (KillWait=5 s on this cluster)
    assert 3 <= elapsed < 40, elapsed
    assert _squeue_state(slurm_cluster, handle["job_id"]) == "CANCELLED"
    psutil.wait_procs(_workers(handle["job_dir"]), timeout=15)
    assert not _workers(handle["job_dir"]), "the workload survived the cancel"


def test_a_forgotten_job_that_could_not_start_stays_that_failure(backend, tmp_path):
    job_dir = tmp_path / "runs" / "late"
    job_dir.mkdir(parents=True)
    (job_dir / "request.json").write_text("{}")
    (job_dir / "start_failure.json").write_text(json.dumps(
        {"message": "Slurm job 987655 did not start within the startup timeout",
         "failure": "transient"}))
    status = backend.status({"job_id": "987655", "job_dir": str(job_dir), "key": "late"})
    assert (status.state, status.failure) == (JobState.FAILED, FailureKind.TRANSIENT)
    assert "did not start within the startup timeout" in status.message
