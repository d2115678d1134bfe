"""Which node a failed two-node Ray job lost, from its node tasks' ends (no cluster; the real
run: tests/e2e/test_ray_two_nodes.py)."""

from __future__ import annotations

from trainforge.engines.ray.node_loss import NODE_LOSS, describe, lost_node

H0 = {"node": 0, "host": "h0", "address": "10.0.0.10"}
H1 = {"node": 1, "host": "h1", "address": "10.0.0.11"}


def test_a_killed_agent_is_named_though_the_survivor_ended_first():
    ended = [{**H0, "exit_code": 1, "seen_at": 100.4, "ended_at": 100.3},   # its peer went away
             {**H1, "exit_code": -9, "seen_at": 100.5, "ended_at": 100.0}]  # SIGKILLed agent
    loss = lost_node(ended, 2)
    assert loss["kind"] == NODE_LOSS and loss["node"] == "h1 (10.0.0.11)", loss
    assert loss["survivors"] == ["h0 (10.0.0.10)"] and "SIGKILL" in loss["source"], loss
    assert loss["lost_at"] == 100.0 and loss["detection_s"] == 0.5, loss
    assert describe(loss).startswith("node h1 (10.0.0.11) lost (Ray: node 1 of 2: its torchrun")


def test_a_task_ray_lost_is_named_but_not_one_the_launcher_cancelled():
    died = {**H1, "exit_code": None, "error": "NodeDiedError: the node died", "seen_at": 50.0}
    cancelled = {**H0, "exit_code": None, "error": "TaskCancelledError: cancelled",
                 "seen_at": 49.0}
    stopped = {**H0, "exit_code": None, "error": "KeyError: ", "cancelled": True,
               "seen_at": 49.0}  # cancelled by the launcher, whatever Ray raised
    assert lost_node([stopped, {**H1, "exit_code": 1, "seen_at": 48.0}], 2) is None
    loss = lost_node([cancelled, died], 2)
    assert loss["node"] == "h1 (10.0.0.11)" and "NodeDiedError" in loss["source"], loss
    assert loss["detection_s"] == 0.0, loss  # no end of its own: counted from Ray's report


def test_rank_failures_and_one_node_jobs_name_nobody():
    ended = [{**H0, "exit_code": 1, "seen_at": 1.0}, {**H1, "exit_code": 1, "seen_at": 2.0}]
    assert lost_node(ended, 2) is None
    assert lost_node([{**H0, "exit_code": -9, "seen_at": 1.0}], 1) is None
    assert lost_node([{**H0, "exit_code": 0, "seen_at": 1.0}, {**H1, "exit_code": 0,
                                                                "seen_at": 1.0}], 2) is None
