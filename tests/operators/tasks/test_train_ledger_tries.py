"""The ledger over every try (operators/train_ledger.py, operators/ledger/tries.py).

Against a real MLflow server: a stage's first try fails before its trainer wrote any attempt
record (energy estimated with reasons, buckets unknown, cost partial); its retry's attempt
records read every device. Each outcome's ledger is at its own step with ``ledger/try``, and
every tag of try 1's ledger that try 2's does not set is gone, from the stage's run and from the
DAG run's run. Without a server: the window and the orchestrator's buckets over two tries.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from trainforge.hooks.mlflow import MlflowHook
from trainforge.ledger import names as n
from trainforge.ledger.build import build_ledger
from trainforge.ledger.catalog import Price
from trainforge.ledger.tries import earlier_tries, try_ended, try_records, try_started
from trainforge.pipeline import load_spec, validate_overrides
from trainforge.train_ledger import record_ledger, record_try_started, stale_tags

DEMO = Path(__file__).resolve().parents[3] / "dags" / "pipelines" / "shakespeare_llm.yaml"
PRICE = Price("USD", "test", "2026-01-01", per_gpu_hour=2.0, per_cpu_core_hour=0.05)


@pytest.fixture
def gpu_spec():
    return validate_overrides(load_spec(DEMO), {"training.resources.gpus_per_node": 2,
                                                "training.resources.processes_per_node": 2})


def _record(started: float, step: int, final: bool) -> dict:
    gpus = {f"gpu{i}": {"uuid": f"GPU-{i}", "source": "measured-nvml", "energy_j": 3.6e5}
            for i in (1, 3)}
    return {"v": 1, "started_at": started, "first_step_at": started + 2, "recorded_at": started + 12,
            "final": final, "step": step, "productive_steps": step, "tokens_per_step": 64,
            "world_size": 2, "device": "NVIDIA H100", "flops_per_token": 1e6,
            "seconds": {"startup": 2.0, "productive": 10.0}, "gpus": gpus,
            "energy_j": {"gpu": 7.2e5, "cpu": 1.8e5}, "energy_source": {"gpu": "measured-nvml",
                                                                        "cpu": "measured-rapl"}}


def _handle(try_number: int, submitted: float) -> dict:
    return {"engine": "local", "key": f"job-{try_number}", "submitted_at_epoch_s": submitted,
            "identity": {"try_number": try_number}}


def _history_steps(hook, run_id, key):
    return sorted(m.step for m in hook.client.get_metric_history(run_id, key))


@pytest.mark.integration
def test_a_retry_replaces_every_tag_of_the_earlier_try_and_logs_at_its_own_step(mlflow_server,
                                                                                gpu_spec):
    hook = MlflowHook(tracking_uri=mlflow_server)
    parent = hook.get_or_create_run(f"ledger-tries-{time.time_ns()}", "tiny", "manual__1")
    child = hook.get_or_create_child_run(parent, "sft")
    t0 = time.time() - 60
    record_try_started(hook, child, 1, t0, _handle(1, t0 + 1))
    failed = {"status": "error", "message": "killed", "handle": _handle(1, t0 + 1),
              "ended_at_epoch_s": t0 + 20, "wall_s": 19.0}
    record_ledger(hook, gpu_spec, failed, PRICE, own_run=child, parent_run=parent, stage="sft",
                  task_started_s=t0, try_number=1)
    before = hook.get_run(child).data.tags
    # what try 1's ledger said and try 2's must not leave behind
    for key in (n.energy_reason_tag("gpu"), n.energy_reason_tag("cpu"), n.unknown_tag("queue_wait"),
                n.unknown_tag("program_startup"), n.unknown_tag("tps")):
        assert key in before, key
    assert before[n.ENERGY_STATUS] == before[n.COST_STATUS] == "partial"
    assert "stage/sft/" + n.energy_reason_tag("gpu") in hook.get_run(parent).data.tags

    # try 2: its trainer's attempt records read every device
    hook.set_tags(child, {f"trainforge.ledger.attempt.{int((t0 + 30) * 1000)}":
                          json.dumps(_record(t0 + 30, 40, True))})
    record_try_started(hook, child, 2, t0 + 28, _handle(2, t0 + 29))
    success = {"status": "success", "message": "done", "handle": _handle(2, t0 + 29),
               "ended_at_epoch_s": t0 + 43, "wall_s": 14.0,
               "phases": {"queue_wait": 0.4, "image_pull": 0.0}}
    ledger = record_ledger(hook, gpu_spec, success, PRICE, own_run=child, parent_run=parent,
                           stage="sft", task_started_s=t0 + 28, try_number=2)
    run = hook.get_run(child)
    tags = run.data.tags
    own = {k: v for k, v in tags.items() if k.split("/")[0] in ("ledger", "energy", "cost")}
    assert own == ledger.tags and tags[n.TRY] == "2"
    assert tags[n.ENERGY_STATUS] == tags[n.COST_STATUS] == "complete"
    assert not [k for k in tags if k.startswith("energy/reason/")]
    assert n.unknown_tag("queue_wait") not in tags and run.data.metrics[n.badput("queue_wait")] == 0.4
    shared = hook.get_run(parent).data.tags
    on_parent = {k[len("stage/sft/"):]: v for k, v in shared.items() if k.startswith("stage/sft/")}
    assert on_parent == ledger.tags
    # each outcome at its own step, in both runs; the window opens at try 1's start
    assert _history_steps(hook, child, n.GOODPUT) == [1, 2]
    assert _history_steps(hook, parent, "stage/sft/" + n.GOODPUT) == [1, 2]
    assert ledger.window["start"] == pytest.approx(t0) and ledger.window["tries"] == 2
    assert run.data.metrics[n.GPU_HOURS_ALLOCATED] == pytest.approx(ledger.books.wall_s / 3600 * 2)
    tries = try_records(tags)
    assert tries[1]["outcome"] == "error" and tries[1]["job_ended_at"] == t0 + 20
    assert tries[2]["outcome"] == "success" and tries[2]["phases"] == {"queue_wait": 0.4,
                                                                        "image_pull": 0.0}


def test_stale_tags_are_the_ledgers_own_only():
    old = {"ledger/queue_wait": "unknown", "energy/reason/gpu1": "x", "cost/status": "partial",
           "trainforge.train.job": "j", "stage/a/ledger/tps": "unknown", "ledgerish": "y"}
    assert stale_tags(old, {"cost/status": "complete"}) == ["energy/reason/gpu1", "ledger/queue_wait"]
    assert stale_tags(old, {}, "stage/a/") == ["stage/a/ledger/tps"]


def test_the_window_and_the_orchestrators_buckets_span_every_try(gpu_spec):
    t0 = 1_000_000.0
    # try 1: started t0, submitted t0+2, queued 1 s; its attempt ran t0+3..t0+15 (last flush),
    # killed at t0+18, the try ended at t0+19. Try 2: started t0+25, submitted t0+26, queued 2 s;
    # its attempt ran t0+29..t0+41, the job ended at t0+42, the try at t0+44.
    first = {**_record(t0 + 3, 5, False), "recorded_at": t0 + 15}
    second = {**_record(t0 + 29, 10, True), "recorded_at": t0 + 41}
    tags = {f"trainforge.ledger.attempt.{i}": json.dumps(r) for i, r in enumerate((first, second))}
    try1 = try_ended(try_started(1, t0, _handle(1, t0 + 2)), 1, t0,
                     {"status": "error", "handle": _handle(1, t0 + 2), "ended_at_epoch_s": t0 + 18,
                      "phases": {"queue_wait": 1.0, "image_pull": "unknown: not said"}}, t0 + 19)
    assert try1["phases"] == {"queue_wait": 1.0}
    tags["trainforge.ledger.try.1"] = json.dumps(try1)
    event = {"status": "success", "handle": _handle(2, t0 + 26), "ended_at_epoch_s": t0 + 42,
             "phases": {"queue_wait": 2.0, "image_pull": 0.0}}
    ledger = build_ledger(gpu_spec, event, tags, PRICE, task_started_s=t0 + 25, now_s=t0 + 44,
                          submitted_by_this_try=True, earlier_tries=earlier_tries(tags, 2))
    m = ledger.metrics
    assert m[n.WALL_S] == pytest.approx(44.0)  # try 1's start to try 2's end
    # each try's start -> submission, and job end -> try end
    assert m[n.badput("orchestration")] == pytest.approx(2 + 1 + 1 + 2)
    assert m[n.badput("queue_wait")] == pytest.approx(3.0)
    # last flush (t0+15) -> next attempt (t0+29) = 14 s, less try 1's end (1 s), try 2's
    # submission (1 s) and queue (2 s), which lie inside it under their own names
    assert m[n.badput("recovery")] == pytest.approx(14 - 1 - 1 - 2)
    assert m[n.PRODUCTIVE_S] + sum(m[n.badput(b)] for b in n.BUCKETS if n.badput(b) in m) \
        == pytest.approx(m[n.WALL_S])
    assert m[n.badput("other")] >= 0
    assert m[n.GPU_HOURS_ALLOCATED] == pytest.approx(44.0 / 3600 * 2)
    assert m[n.COST_ALLOCATED] == pytest.approx(PRICE.cost(44.0 / 3600, 44.0 / 3600 * 2,
                                                           44.0 / 3600 * 2 * 1))
    assert m[n.ENERGY_KWH] == pytest.approx(2 * (7.2e5 + 1.8e5) / 3.6e6)  # both attempts read
