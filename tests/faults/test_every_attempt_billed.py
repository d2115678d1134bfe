"""Every attempt on the bill: a real trainer SIGKILLed between two flushes, then resumed by the
task's retry, against a real MLflow server.

Try 1 of the ``train`` task launches the trainer; it is SIGKILLed after its step-400 checkpoint
and at least one periodic flush (no log interval falls in the run), and the try fails. Try 2
resumes it to the end and succeeds. The final ledger must hold the killed attempt: its record
up to its last flush (a few seconds before the kill), its steps, and the time up to the kill
inside the window; the buckets, GPU-hours, energy, cost and the task's accounting share that
one window, from try 1's start. Each outcome's ledger is at its own step (the try number,
``ledger/try``), and try 1's tag ``ledger/queue_wait`` (the engine did not say), which try 2
contradicts, is gone.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import time

import psutil
import pytest

from faultlib import wait_for
from tests.trainer.conftest import REPO_ROOT, make_job, trainer_command, trainer_env, write_job
from trainforge.accounting import account
from trainforge.hooks.mlflow import MlflowHook
from trainforge.ledger import names as n
from trainforge.ledger.attempts import attempt_records
from trainforge.pipeline import load_spec
from trainforge.pipeline.spec import PipelineSpec
from trainforge.tasks.train import TrainOperator
from trainforge.trainer.goodput import FLUSH_EVERY_S

pytestmark = [pytest.mark.integration]

SPEC = REPO_ROOT / "tests" / "faults" / "fault_tiny.yaml"
# A flush between two checkpoints needs FLUSH_EVERY_S of training after one (a checkpoint
# flushes too, and starts the interval again): checkpoints far enough apart on a fast machine,
# and the kill well before the end.
MAX_STEPS, CHECKPOINT_EVERY = 3600, 1500
LEDGER_ROOTS = ("goodput/", "badput/", "gpu_hours/", "energy/", "cost/", "tps", "tflops", "mfu_pct",
                "disruptions/", "recovery/", "checkpoint/background")


class FakeTI:
    """The task instance fields the train task reads."""

    def __init__(self, try_number: int, started: float):
        self.dag_id, self.run_id, self.task_id, self.try_number = "fault_tiny", "manual__r1", "train", try_number
        self.start_date = dt.datetime.fromtimestamp(started, dt.timezone.utc)

    def xcom_pull(self, task_ids=None, key=None):
        return None

    def xcom_push(self, key, value):
        pass


def _record_file(job_dir):
    files = sorted((job_dir / "ledger").glob("attempt-*.json"))
    return json.loads(files[0].read_text()) if files else None


def _flushed_between_checkpoints(job_dir) -> bool:
    record = _record_file(job_dir)
    return bool(record and not record["final"]
                and CHECKPOINT_EVERY < record["step"] < 2 * CHECKPOINT_EVERY)


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return  # it ended already: the assertion before says how
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def _try(raw, server, try_number, started, submitted):
    op = TrainOperator(task_id="train", spec=raw, mlflow_tracking_uri=server)
    context = {"ti": FakeTI(try_number, started), "params": {}, "task": op}
    handle = {"engine": "local", "key": f"fault_tiny-train-{try_number}",
              "submitted_at_epoch_s": submitted,
              "identity": {"dag_id": "fault_tiny", "run_id": "manual__r1", "task_id": "train",
                           "try_number": try_number}}
    op.job_attached(context, op.resolved_spec(context), handle)
    return op, context, handle


def test_a_sigkilled_attempt_is_billed_in_the_final_ledger_over_one_window(tmp_path, tiny_dataset,
                                                                            mlflow_server):
    raw = load_spec(SPEC).model_dump(mode="json")
    raw["pipeline"]["mlflow_experiment"] = f"every-attempt-{time.time_ns()}"
    raw["training"]["resources"].update(gpus_per_node=1, processes_per_node=1)
    raw["cost"].update(gpu_hour_price=2.5, cpu_hour_price=0.04, currency="EUR")
    spec = PipelineSpec.model_validate(raw)
    hook = MlflowHook(tracking_uri=mlflow_server)
    run_id = hook.get_or_create_run(spec.experiment_name, "fault_tiny", "manual__r1")
    job = write_job(tmp_path / "job.json", make_job(
        tiny_dataset, tmp_path / "ck", optim={"max_steps": MAX_STEPS, "warmup_steps": 2},
        checkpoint={"interval_steps": CHECKPOINT_EVERY, "keep_last": 2},
        logging={"log_every_steps": 100_000}))  # no log interval: only flushes and checkpoints
    env = trainer_env(tmp_path / "result.json", MLFLOW_TRACKING_URI=mlflow_server,
                      MLFLOW_RUN_ID=run_id, TRAINFORGE_JOB_DIR=str(tmp_path / "job"))

    # Try 1: its trainer is SIGKILLed after a flush that fell between two checkpoints.
    try1_started = time.time()
    op1, ctx1, handle1 = _try(raw, mlflow_server, 1, try1_started, try1_started + 0.5)
    time.sleep(0.5)
    log1 = tmp_path / "attempt1.log"
    with open(log1, "w") as out:
        proc = subprocess.Popen(trainer_command(job), cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for("a flush between two checkpoints", lambda: proc.poll() is not None
                     or _flushed_between_checkpoints(tmp_path / "job"), 240, 0.05)
            assert proc.poll() is None, log1.read_text()[-3000:]
            time.sleep(1.0)  # the kill comes after the last flush: that tail only the task knows
        finally:
            killed_at = time.time()
            _kill_tree(proc)
    killed = _record_file(tmp_path / "job")
    assert not killed["final"] and CHECKPOINT_EVERY < killed["step"] < MAX_STEPS, killed
    assert killed_at - FLUSH_EVERY_S - 2.0 < killed["recorded_at"] <= killed_at
    assert killed["seconds"]["productive"] > 0 and killed["productive_steps"] == killed["step"]
    tags = hook.get_run(run_id).data.tags
    assert [r["recorded_at"] for r in attempt_records(tags)] == [killed["recorded_at"]]  # MLflow too
    failed = {"status": "error", "message": "job fault_tiny-train-1 failed (transient): SIGKILL",
              "handle": handle1, "job": {}, "exit_code": -9, "failure": "transient",
              "result": {}, "wall_s": killed_at + 0.2 - handle1["submitted_at_epoch_s"],
              "ended_at_epoch_s": killed_at + 0.2}
    with pytest.raises(RuntimeError):
        op1.execute_complete(ctx1, failed, first_start_epoch_s=try1_started)
    run = hook.get_run(run_id)
    assert run.data.tags[n.unknown_tag("queue_wait")].startswith("unknown: the local engine")
    assert run.data.tags[n.TRY] == "1"

    # Try 2: after the retry delay, the resumed trainer finishes.
    time.sleep(1.0)
    try2_started = time.time()
    op2, ctx2, handle2 = _try(raw, mlflow_server, 2, try2_started, try2_started + 0.3)
    resumed = subprocess.run(trainer_command(job), cwd=REPO_ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    ended = time.time()
    result = json.loads((tmp_path / "result.json").read_text())
    success = {"status": "success", "message": "job fault_tiny-train-2 finished", "handle": handle2,
               "job": {}, "wall_s": ended - handle2["submitted_at_epoch_s"], "ended_at_epoch_s": ended,
               "phases": {"queue_wait": 0.25, "image_pull": "not applicable: a local process"},
               "result": result}
    op2.execute_complete(ctx2, success, first_start_epoch_s=try2_started)
    finished = time.time()

    run = hook.get_run(run_id)
    m, tags = run.data.metrics, run.data.tags
    first, second = attempt_records(tags)
    assert first["recorded_at"] == killed["recorded_at"] and second["final"]
    # One window, from try 1's start to try 2's end: the killed attempt's time is inside it.
    assert try1_started <= first["started_at"]
    assert finished - try1_started - 0.5 <= m[n.WALL_S] <= finished - try1_started + 0.01
    assert m[n.DISRUPTIONS] == 1
    assert m[n.PRODUCTIVE_S] >= first["seconds"]["productive"] + second["seconds"]["productive"] - 0.01
    assert m[n.PRODUCTIVE_S] + sum(m[n.badput(b)] for b in n.BUCKETS if n.badput(b) in m) \
        == pytest.approx(m[n.WALL_S], rel=1e-6)
    # from the killed attempt's last flush to the resumed attempt's start: the kill's tail, the
    # try's end, the retry delay (try 2's own start-up and queue are under their own names)
    assert m[n.badput("recovery")] >= second["started_at"] - killed_at - 0.6
    assert m[n.badput("queue_wait")] == pytest.approx(0.25)
    # GPU-hours, cost, energy and the task's accounting: the same window.
    hours = m[n.WALL_S] / 3600
    assert m[n.GPU_HOURS_ALLOCATED] == pytest.approx(hours * 1)
    usage = account(spec, m[n.WALL_S], "not priced here: the spec's prices")
    assert m[n.COST_ALLOCATED] == pytest.approx(usage["cost"])
    assert m["accounting/wall_s"] == pytest.approx(m[n.WALL_S])
    assert m["accounting/gpu_hours"] == pytest.approx(m[n.GPU_HOURS_ALLOCATED])
    assert m["accounting/cost"] == pytest.approx(m[n.COST_ALLOCATED])
    gpu_kwh = hours * spec.cost.gpu_power_watts / 1000  # the trainer read no GPU: estimated
    cpu_hours = hours * spec.training.resources.processes_per_node * spec.training.resources.cpus_per_process
    if "cpu" in (first.get("energy_j") or {}) and "cpu" in (second.get("energy_j") or {}):
        cpu_kwh = (first["energy_j"]["cpu"] + second["energy_j"]["cpu"]) / 3.6e6  # both attempts
    else:
        cpu_kwh = cpu_hours * spec.cost.cpu_core_power_watts / 1000
    assert m[n.ENERGY_KWH] == pytest.approx(gpu_kwh + cpu_kwh)
    ledger = _artifact(hook, run_id, tmp_path)
    assert ledger["window"]["tries"] == 2 and ledger["window"]["attempts"] == 2
    assert ledger["window"]["start"] == pytest.approx(try1_started, abs=1e-3)

    # One value per step: each outcome at its try's step; the latest is try 2's.
    for key in (k for k in m if k.startswith(LEDGER_ROOTS)):
        steps = [x.step for x in hook.client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)
    assert sorted(x.step for x in hook.client.get_metric_history(run_id, n.GOODPUT)) == [1, 2]
    assert tags[n.TRY] == "2"
    # No stale tag: the run's ledger tags are exactly try 2's ledger's (its own prefixes, and the
    # compile/mode and checkpoint/staging it writes over every attempt).
    own = {k: v for k, v in tags.items()
           if k.split("/")[0] in ("ledger", "energy", "cost") or k in ledger["tags"]}
    assert own == ledger["tags"]
    assert {n.COMPILE_MODE, n.CHECKPOINT_STAGING} <= set(ledger["tags"])
    assert n.unknown_tag("queue_wait") not in tags


def _artifact(hook, run_id, tmp_path):
    path = hook.client.download_artifacts(run_id, n.ARTIFACT, str(tmp_path))
    return json.loads(open(path).read())
