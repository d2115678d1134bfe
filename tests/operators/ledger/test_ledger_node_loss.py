"""A try whose job lost a node: the ledger names the ``node_loss`` disruption, the node and the
time from the node's last sign of life to the failure's report, in the try's record and over
every later try; and the Slurm engine's reading of which node was lost (never the survivor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainforge.engines.slurm.node_loss import describe, job_nodelist, node_lost
from trainforge.ledger.build import build_ledger
from trainforge.ledger.catalog import choose_price
from trainforge.ledger.disruptions import NODE_LOSS, event_disruption
from trainforge.ledger.tries import earlier_tries, encode, try_ended, try_tag
from trainforge.pipeline import load_spec
from tests.operators.ledger.test_ledger_books import record, tags_of

DEMO = Path(__file__).resolve().parents[3] / "dags" / "pipelines" / "shakespeare_llm.yaml"
LOSS = {"kind": NODE_LOSS, "node": "h1", "source": "srun: its task 1 was the first to end: Killed",
        "survivors": ["h0"], "lost_at": 1029.0, "detected_at": 1031.5, "detection_s": 2.5}

SRUN_AGENT_KILLED = """trainforge: Slurm job 7 on h[0-1]; rendezvous 10.9.0.1:29507
step 12/300 | loss 3.1
srun: error: h1: task 1: Killed
srun: Terminating StepId=7.0
srun: error: h0: task 0: Killed
"""
SURVIVOR_FIRST = """trainforge: Slurm job 8 on h[0-1]; rendezvous 10.9.0.1:29508
srun: error: h0: task 0: Exited with exit code 1
srun: error: Node failure on h1
"""


def test_the_first_task_killed_names_the_lost_node_not_the_survivor_srun_killed_after():
    assert job_nodelist(SRUN_AGENT_KILLED) == "h[0-1]"
    node, source = node_lost(SRUN_AGENT_KILLED, {"h0": "idle", "h1": "idle"})
    assert node == "h1" and "Killed" in source


def test_slurms_word_beats_the_first_task_to_end():
    # The survivor's rank saw its peer go and exited first; the controller names the lost node.
    assert node_lost(SURVIVOR_FIRST, {})[0] == "h1"
    survivor_only = SURVIVOR_FIRST.replace("srun: error: Node failure on h1\n", "")
    assert node_lost(survivor_only, {"h0": "mixed", "h1": "down*"})[0] == "h1"
    # A task that exited with a code is a rank's failure, not a lost node: nobody is named.
    assert node_lost(survivor_only, {"h0": "idle", "h1": "idle"}) is None


def test_the_failed_try_record_and_the_ledger_carry_the_node_loss():
    spec = load_spec(DEMO)
    event = {"status": "error", "message": f"Slurm job 7 FAILED (exit code 1): {describe(LOSS)}",
             "handle": {"submitted_at_epoch_s": 999.0, "identity": {"try_number": 1}},
             "result": {"disruption": LOSS}, "ended_at_epoch_s": 1030.0}
    assert "node h1 lost" in event["message"] and "h0" not in event["message"]
    assert event_disruption(event)["node"] == "h1"
    first_try = try_ended(None, 1, 998.0, event, 1032.0)
    assert first_try["disruption"] == LOSS
    ledger = build_ledger(spec, event, tags_of(record(1000.0, 1002.5, 1029.0, productive=20.0)),
                          choose_price(spec), task_started_s=998.0, now_s=1032.0,
                          submitted_by_this_try=True, try_number=1)
    assert ledger.metrics["disruptions/node_loss"] == 1.0
    assert ledger.metrics["disruptions/node_loss/detection_max_s"] == pytest.approx(2.5)
    assert ledger.tags["ledger/disruptions/node_loss"] == \
        "try 1: h1, reported 2.5 s after its last sign of life"
    assert "disruptions/node_loss/steps_recomputed" not in ledger.metrics  # no retry yet: unknown
    # The retry (try 2) succeeds: its ledger still attributes try 1's end to the lost node.
    tags = {try_tag(1): encode(first_try)}
    success = {"status": "success", "handle": {"submitted_at_epoch_s": 1040.0,
                                               "identity": {"try_number": 2}},
               "result": {"status": "success"}, "ended_at_epoch_s": 1090.0}
    resumed = record(1045.0, 1048.0, 1089.0, productive=30.0, resumed=10, step=40)
    resumed["reached_step"] = 17  # the furthest step try 1 reached: 7 steps recomputed
    retry = build_ledger(spec, success, tags_of(record(1000.0, 1002.5, 1029.0, productive=20.0),
                                                resumed),
                         choose_price(spec), task_started_s=1035.0, now_s=1091.0,
                         submitted_by_this_try=True, earlier_tries=earlier_tries(tags, 2),
                         try_number=2)
    assert retry.metrics["disruptions/node_loss"] == 1.0
    assert retry.metrics["disruptions/count"] == 1.0
    assert retry.tags["ledger/disruptions/node_loss"] == \
        "try 1: h1, reported 2.5 s after its last sign of life, 7 steps recomputed"
    assert retry.metrics["disruptions/node_loss/steps_recomputed"] == 7.0  # resumed 10, reached 17
    assert "disruption" not in try_ended(None, 2, 1035.0, success, 1091.0)
    assert json.loads(encode(first_try))["disruption"]["node"] == "h1"
