"""A disruption's steps recomputed: those the first attempt started after its ``lost_at`` trained
again (resumed step -> the furthest step reached before), summed per kind and said per try;
unknown, so neither logged nor said, until such an attempt exists."""

from __future__ import annotations

from trainforge.ledger.disruptions import NODE_LOSS, disruption_figures, steps_recomputed

KEY = "disruptions/node_loss/steps_recomputed"
TAG = "ledger/disruptions/node_loss"


def loss(node: str, lost_at: float, detection: float = 1.2) -> dict:
    return {"kind": NODE_LOSS, "node": node, "source": "srun: Killed", "survivors": ["h0"],
            "lost_at": lost_at, "detected_at": lost_at + detection, "detection_s": detection}


def attempt(started: float, resumed: int, reached: int) -> dict:
    return {"started_at": started, "recorded_at": started + 30.0, "first_step_at": started + 3.0,
            "resumed_step": resumed, "reached_step": reached, "step": reached + 5,
            "wasted_steps": reached - resumed, "seconds": {}}


def test_the_attempt_after_a_node_loss_recomputes_from_its_resumed_step_to_the_reached_one():
    tries = [{"try": 1, "disruption": loss("h1", 1029.0)}, {"try": 2}]
    records = [attempt(1000.0, 0, 0), attempt(1045.0, 10, 17)]
    metrics, tags = disruption_figures(tries, records=records)
    assert metrics[KEY] == 7.0
    assert tags[TAG] == "try 1: h1, reported 1.2 s after its last sign of life, 7 steps recomputed"


def test_no_attempt_after_the_loss_yet_gives_no_figure_and_no_text():
    tries = [{"try": 1, "disruption": loss("h1", 1029.0)}]  # the failed try's own ledger
    for records in (None, [attempt(1000.0, 0, 0)]):
        metrics, tags = disruption_figures(tries, records=records)
        assert KEY not in metrics and metrics["disruptions/node_loss"] == 1.0
        assert tags[TAG] == "try 1: h1, reported 1.2 s after its last sign of life"


def test_two_node_losses_are_summed_and_each_said():
    tries = [{"try": 1, "disruption": loss("h1", 1029.0)},
             {"try": 2, "disruption": loss("h0", 1100.0, 0.6)}, {"try": 3}]
    records = [attempt(1000.0, 0, 0), attempt(1045.0, 10, 17), attempt(1080.0, 20, 20),
               attempt(1120.0, 30, 42)]
    metrics, tags = disruption_figures(tries, records=records)
    assert metrics[KEY] == 7.0 + 12.0  # 1045 is the first after 1029; 1120 the first after 1100
    assert metrics["disruptions/node_loss"] == 2.0
    assert metrics["disruptions/node_loss/detection_max_s"] == 1.2
    assert tags[TAG] == ("try 1: h1, reported 1.2 s after its last sign of life, 7 steps "
                         "recomputed; try 2: h0, reported 0.6 s after its last sign of life, "
                         "12 steps recomputed")


def test_an_attempt_started_before_the_loss_is_not_counted():
    # The attempt that was running when the node went (resumed at 10, reached 17) is not the one
    # that recomputed; the restart after the loss resumed at 20 and had reached 20: nothing again.
    records = [attempt(1045.0, 10, 17), attempt(1050.0, 20, 20)]
    assert steps_recomputed(loss("h1", 1049.0), records) == 0
    assert steps_recomputed(loss("h1", 1060.0), records) is None
    # A record without step numbers (an older trainer), or a loss without its time: unknown.
    assert steps_recomputed(loss("h1", 1000.0), [{"started_at": 1045.0, "seconds": {}}]) is None
    assert steps_recomputed({"kind": NODE_LOSS, "node": "h1"}, records) is None
    metrics, tags = disruption_figures([{"try": 1, "disruption": loss("h1", 1049.0)}],
                                       records=records)
    assert metrics[KEY] == 0.0 and tags[TAG].endswith(", 0 steps recomputed")


def test_an_in_job_restart_is_a_restart_disruption_in_the_try_record_and_the_ledger():
    """The job's result lists its restarts (trainforge.engines.root_cause.restarts); the try
    record keeps them and the ledger counts each, with its cause and the steps trained again."""
    from trainforge.ledger.tries import try_ended

    restart = {"kind": "restart", "index": 1, "node": "h1", "rank": 1, "lost_at": 1029.0, "detected_at": 1031.5,
               "detection_s": 2.5, "cause": "rank 1 on h1 (10.0.0.2) raised ValueError during step 13: bad token"}
    event = {"status": "success", "message": "finished", "handle": {"key": "j"}, "result": {"restarts": [restart]}}
    record = try_ended(None, 1, 1000.0, event, 1100.0)
    assert record["restarts"] == [restart] and "disruption" not in record
    metrics, tags = disruption_figures([record], records=[attempt(1000.0, 0, 0), attempt(1031.5, 10, 13)])
    assert metrics["disruptions/restart"] == 1.0 and metrics["disruptions/restart/steps_recomputed"] == 3.0
    assert tags["ledger/disruptions/restart"] == (
        "try 1, restart 1: rank 1 on h1 (10.0.0.2) raised ValueError during step 13: bad token; restarted 2.5 s "
        "after, 3 steps recomputed")
