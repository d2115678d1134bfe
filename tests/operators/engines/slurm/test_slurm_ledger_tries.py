"""One ledger across the tries of a Slurm task without MLflow, for real: the one-node Slurm
cluster of tests/slurm_cluster.py, the trainer under srun + torchrun, no MLflow anywhere.

Each try is its own Slurm job with its own job folder. Try 1's rank is SIGKILLed past its
step-100 checkpoint; try 2 (a new job, a new folder) resumes from that checkpoint and finishes.
Both wrote their attempt records to the task's ledger folder (``$TRAINFORGE_LEDGER_DIR``, beside
the checkpoints, as the ``train`` task sets it), so try 2's trainer counts the steps it trains
again as wasted, and the ledger built from that folder holds both attempts: one disruption,
the re-trained steps in ``wasted_progress``. Try 2's own job folder holds only its own record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.slurm.backend import SlurmBackend
from trainforge.ledger import names as n
from trainforge.ledger.attempts import attempt_records, job_dir_records, merge_records
from trainforge.ledger.build import build_ledger
from trainforge.pipeline import load_spec
from trainforge.train_ledger import ledger_dir, ledger_env, task_records
from tests.faults.faultlib import wait_for
from tests.slurm_cluster import slurm_cluster  # noqa: F401 - the session's Slurm cluster
from tests.trainer.conftest import REPO_ROOT, build_dataset, make_job

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

MAX_STEPS, CHECKPOINT_EVERY = 300, 100


def _newest_record(folder: Path) -> dict | None:
    records = [json.loads(p.read_text()) for p in folder.glob("attempt-*.json")] if folder.is_dir() else []
    return max(records, key=lambda r: r["recorded_at"]) if records else None


def _rank_pids(job_dir: Path) -> list[int]:
    """The trainer ranks of the job in ``job_dir`` (children of torchrun, not torchrun itself):
    selected by the job's own folder, so a trainer of anything else on the machine is left
    alone."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if ("trainforge.trainer.train" in cmdline and "torch.distributed.run" not in cmdline
                and str(job_dir) in cmdline):
            found.append(proc.info["pid"])
    return found


def test_the_retry_of_a_killed_slurm_try_bills_its_wasted_steps_without_mlflow(
        tmp_path, slurm_cluster):  # noqa: F811 - the fixture imported above
    dataset = build_dataset(tmp_path / "data" / "tiny")
    checkpoints = tmp_path / "checkpoints"
    config = make_job(dataset, checkpoints,
                      optim={"max_steps": MAX_STEPS, "warmup_steps": 2},
                      checkpoint={"interval_steps": CHECKPOINT_EVERY, "keep_last": 2},
                      logging={"log_every_steps": 1})
    folder = Path(ledger_dir(str(checkpoints)))
    backend = SlurmBackend(tmp_path / "runs")
    env = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    assert not env, env  # no MLflow: the ranks get no tracking URI

    def job(try_number: int) -> TrainingJob:
        return TrainingJob(
            identity=JobIdentity("ledger_tries", "manual__1", "train", try_number),
            config={**config, "identity": {**config["identity"], "try_number": try_number}},
            module="trainforge.trainer.train", nodes=1, processes_per_node=1,
            env=ledger_env(str(checkpoints)), engine_options={"python": sys.executable},
            max_runtime_s=600.0, startup_timeout_s=120.0)

    # An unrelated trainer on the machine (its command line names the trainer's module too):
    # the kill below selects try 1's ranks by their job folder and leaves this one alone.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                                  "-m", "trainforge.trainer.train", "--config", "elsewhere.json"])
    try:
        _killed_try_then_retry(tmp_path, backend, job, folder, checkpoints)
        assert bystander.poll() is None, "the kill took an unrelated trainer with it"
    finally:
        bystander.kill()
        bystander.wait()


def _killed_try_then_retry(tmp_path, backend, job, folder, checkpoints) -> None:
    first = backend.submit(job(1))
    started_1 = time.time()
    killed = wait_for("try 1's record past its step-100 checkpoint", lambda: (
        (r := _newest_record(folder)) and r["step"] > CHECKPOINT_EVERY + 5 and r)
        or backend.status(first).state.terminal, 240, 0.05)
    assert killed is not True, backend.status(first)
    ranks = _rank_pids(backend.job_dir(job(1).identity))
    assert ranks, "no rank of try 1 found by its job folder"
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    status = wait_for("try 1 to fail", lambda: (s := backend.status(first)).state.terminal and s, 60, 0.25)
    assert status.state is JobState.FAILED, status
    killed = _newest_record(folder)
    assert not killed["final"] and CHECKPOINT_EVERY < killed["step"] < 2 * CHECKPOINT_EVERY, killed

    second = backend.submit(job(2))
    status = wait_for("try 2 to end", lambda: (s := backend.status(second)).state.terminal and s, 300, 0.25)
    log_2 = (backend.job_dir(job(2).identity) / "job.log").read_text(errors="replace")
    assert status.state is JobState.SUCCEEDED, (status, log_2[-3000:])
    assert f"resuming from {checkpoints}/step-{CHECKPOINT_EVERY:08d}" in log_2, log_2[-3000:]
    # Try 2's job folder is its own: it holds only try 2's record.
    assert len(job_dir_records(backend.job_dir(job(2).identity))) == 1

    # The task's ledger folder holds both tries' attempts; try 2's trainer counted the steps it
    # trained again (past step 100, up to try 1's last record) as wasted.
    records = attempt_records(merge_records({}, task_records(str(folder))))
    assert len(records) == 2, records
    retry = records[1]
    assert retry["final"] and retry["resumed_step"] == CHECKPOINT_EVERY, retry
    assert retry["reached_step"] >= killed["step"], (retry, killed)
    assert retry["wasted_steps"] == retry["reached_step"] - CHECKPOINT_EVERY > 0, retry
    spec = load_spec(REPO_ROOT / "tests" / "faults" / "fault_tiny.yaml")
    event = {"status": "success", "handle": dict(second), "ended_at_epoch_s": time.time(),
             "phases": {}}
    ledger = build_ledger(spec, event, merge_records({}, task_records(str(folder))),
                          "not priced here", task_started_s=started_1, now_s=time.time(),
                          submitted_by_this_try=True)
    assert ledger.window["attempts"] == 2
    assert ledger.metrics[n.DISRUPTIONS] == 1
    assert ledger.metrics[n.badput("wasted_progress")] == pytest.approx(
        retry["seconds"]["wasted"]) and retry["seconds"]["wasted"] > 0
