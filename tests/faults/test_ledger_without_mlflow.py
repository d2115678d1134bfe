"""The ``train`` task's ledger over attempts whose trainer never reached MLflow: the task gives
its ranks the task's ledger folder (``$TRAINFORGE_LEDGER_DIR``, beside the checkpoints every try
shares), and at its outcome reads every try's attempt records there, beside the run's tags.

Try 1's attempt was killed at step 37 (its record in the folder only); try 2's attempt, on a new
job folder, resumed the step-30 checkpoint and trained steps 31-37 again. Try 2's ledger, logged
to the run by the task, holds both attempts: one disruption and those steps as wasted progress.
(The trainer under a real Slurm job: tests/operators/engines/slurm/test_slurm_ledger_tries.py.)
"""

from __future__ import annotations

import datetime as dt
import time

import pytest

from tests.trainer.conftest import REPO_ROOT
from trainforge.contract import LEDGER_DIR_ENV
from trainforge.engines.base import JobIdentity
from trainforge.hooks.mlflow import MlflowHook
from trainforge.ledger import names as n
from trainforge.pipeline import load_spec
from trainforge.tasks.train import TrainOperator
from trainforge.train_ledger import ledger_dir
from trainforge.trainer.goodput import AttemptClock

pytestmark = [pytest.mark.integration]

SPEC = REPO_ROOT / "tests" / "faults" / "fault_tiny.yaml"


class FakeTI:
    """The task instance fields the train task reads."""

    def __init__(self, try_number: int, started: float, dataset: str):
        self.dag_id, self.run_id, self.task_id, self.try_number = "fault_tiny", "manual__r1", "train", try_number
        self.start_date = dt.datetime.fromtimestamp(started, dt.timezone.utc)
        self._dataset = dataset

    def xcom_pull(self, task_ids=None, key=None):
        return {"dataset_dir": self._dataset}

    def xcom_push(self, key, value):
        pass


def _attempt(folder: str, started_at: float, resumed: int, steps: range, final: bool) -> dict:
    clock = AttemptClock(world_size=1, tokens_per_step=128, flops_per_token=10, device="cpu",
                         started_at=started_at, ledger_dir=folder)
    clock.restored(0.05, resumed_step=resumed, reached_step=resumed)  # no MLflow: its checkpoint only
    clock.loop_started()
    for step in steps:
        clock.step_started()
        time.sleep(0.01)
        clock.step_done(step)
    clock.snapshot(final=final)
    return clock.record(final=final)


def test_the_train_task_bills_the_attempts_it_finds_only_in_its_ledger_folder(
        tmp_path, mlflow_server, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    raw = load_spec(SPEC).model_dump(mode="json")
    raw["pipeline"]["mlflow_experiment"] = f"ledger-folder-{time.time_ns()}"
    hook = MlflowHook(tracking_uri=mlflow_server)
    op = TrainOperator(task_id="train", spec=raw, mlflow_tracking_uri=mlflow_server)
    started = time.time() - 30
    context = {"ti": FakeTI(2, started + 20, str(tmp_path / "ds")), "params": {}, "task": op}
    spec = op.resolved_spec(context)
    run_id = hook.get_or_create_run(spec.experiment_name, "fault_tiny", "manual__r1")

    job, _ = op.prepare_job(context, spec, JobIdentity("fault_tiny", "manual__r1", "train", 2))
    folder = job.env[LEDGER_DIR_ENV]
    assert folder == ledger_dir(op._checkpoint_dir(spec, context["ti"]))
    _attempt(folder, started, 0, range(1, 38), final=False)         # try 1: killed at step 37
    retry = _attempt(folder, started + 21, 30, range(31, 41), final=True)  # try 2: 31-37 again
    assert retry["reached_step"] == 37 and retry["wasted_steps"] == 7

    ended = time.time()
    handle = {"engine": "slurm", "key": "fault_tiny-train-2", "submitted_at_epoch_s": started + 20.5,
              "identity": {"dag_id": "fault_tiny", "run_id": "manual__r1", "task_id": "train",
                           "try_number": 2}}
    op.job_attached(context, spec, handle)
    success = {"status": "success", "message": "job fault_tiny-train-2 finished", "handle": handle,
               "job": {}, "wall_s": ended - handle["submitted_at_epoch_s"], "ended_at_epoch_s": ended,
               "phases": {"queue_wait": 0.1},
               "result": {"status": "ok", "final_step": 40, "tokens_seen": 40 * 128,
                          "final_train_loss": 2.0}}
    op.execute_complete(context, success, first_start_epoch_s=started + 20)

    m = hook.get_run(run_id).data.metrics
    assert m[n.DISRUPTIONS] == 1
    assert m[n.badput("wasted_progress")] == pytest.approx(retry["seconds"]["wasted"])
    assert retry["seconds"]["wasted"] > 0.05
