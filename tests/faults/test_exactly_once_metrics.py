"""Exactly-once MLflow metrics across a kill and resume (2 ranks, gloo, real MLflow server).

The trainer is SIGKILLed a few steps after a checkpoint, so the next attempt trains those steps
again; the run's metric history must still hold every step exactly once, up to the final step.
The same run checks the ledger's attempt records: one disruption, the steps trained again as
wasted progress, every step productive once, and a productive time that matches the one
bench/goodput.py measures from the step lines within 2 points of goodput.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import psutil
import pytest

from faultlib import wait_for
from trainforge.pipeline import load_spec
from tests.trainer.conftest import REPO_ROOT, make_job, trainer_command, trainer_env, write_job

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

MAX_STEPS = 30
DEMO = REPO_ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"


def _newest_step(log_path) -> int:
    found = re.findall(r"step (\d+)/\d+ \|", log_path.read_text(errors="replace"))
    return int(found[-1]) if found else 0


def _kill_tree(proc: subprocess.Popen) -> None:
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)


def test_kill_after_a_checkpoint_then_resume_logs_every_step_once(tmp_path, tiny_dataset,
                                                                   mlflow_server):
    import mlflow

    client = mlflow.MlflowClient(mlflow_server)
    run_id = client.create_run(client.create_experiment(f"exactly-once-{time.time_ns()}")).info.run_id
    job = write_job(tmp_path / "job.json", make_job(
        tiny_dataset, tmp_path / "ck", optim={"max_steps": MAX_STEPS, "warmup_steps": 2},
        checkpoint={"interval_steps": 10, "keep_last": 2}, logging={"log_every_steps": 1},
    ))
    env = trainer_env(tmp_path / "result.json", MLFLOW_TRACKING_URI=mlflow_server,
                      MLFLOW_RUN_ID=run_id)
    log_path = tmp_path / "attempt1.log"
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(trainer_command(job, nproc=2), cwd=REPO_ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # Past the step-10 checkpoint, before the step-20 one: steps 11.. are logged and lost.
            wait_for("rank 0 past step 12", lambda: proc.poll() is not None
                     or _newest_step(log_path) >= 13, 180, 0.005)
            assert proc.poll() is None, log_path.read_text()[-3000:]
        finally:
            killed_epoch = time.time()
            _kill_tree(proc)
    killed_at = _newest_step(log_path)
    assert 13 <= killed_at < 20, f"killed at step {killed_at}: outside the window the test needs"
    before = sorted(m.step for m in client.get_metric_history(run_id, "train_loss"))
    assert before[-1] > 10, before  # steps past the checkpoint reached MLflow before the kill

    resumed = subprocess.run(trainer_command(job, nproc=2), cwd=REPO_ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resuming from" in resumed.stdout and "step-00000010" in resumed.stdout
    assert "not logged again" in resumed.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_step"] == MAX_STEPS
    for key in ("train_loss", "learning_rate", "grad_norm", "tokens_per_s"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert sorted(steps) == list(range(1, MAX_STEPS + 1)), (key, sorted(steps))
    history = client.get_metric_history(run_id, "train_loss")
    assert max(history, key=lambda m: m.step).value == pytest.approx(result["final_train_loss"])

    _check_the_ledger(client.get_run(run_id).data.tags, before[-1], started,
                      log_path.read_text(errors="replace") + resumed.stdout, killed_epoch)


def _check_the_ledger(tags, logged_before_kill, started, log_text, killed_epoch):
    from bench.goodput import measure, parse_log
    from trainforge.ledger import names as n
    from trainforge.ledger.attempts import attempt_records, sum_attempts
    from trainforge.ledger.build import build_ledger

    first, second = attempt_records(tags)
    assert not first["final"] and second["final"]
    assert second["resumed_step"] == 10 and second["reached_step"] == logged_before_kill
    assert second["wasted_steps"] == logged_before_kill - 10
    assert first["productive_steps"] + second["productive_steps"] == MAX_STEPS
    books = sum_attempts([first, second])
    assert books.buckets["wasted_progress"] > 0 and books.buckets["checkpoint_save"] > 0
    assert books.buckets["recovery"] > 0 and books.recoveries_s[0] > books.buckets["recovery"]

    ledger = build_ledger(load_spec(DEMO), {"handle": {}}, tags, "unknown: not priced here",
                          task_started_s=started, now_s=time.time(), submitted_by_this_try=True)
    m = ledger.metrics
    assert m[n.DISRUPTIONS] == 1
    assert m[n.PRODUCTIVE_S] + sum(m[n.badput(b)] for b in n.BUCKETS if n.badput(b) in m) \
        == pytest.approx(m[n.WALL_S], rel=0.01)
    assert m[n.badput("other")] >= 0

    bench = measure(parse_log(log_text), [killed_epoch], checkpoint_every=10)
    assert bench["kills"] == 1 and bench["steps"] == MAX_STEPS
    ledger_goodput = books.productive_s / bench["wall_s"]  # over the benchmark's own window
    assert abs(100 * ledger_goodput - 100 * bench["goodput"]) <= 2.0, (books, bench)
