"""The pure part of human approval (trainforge.approval): what an answer decides, and the
request a person reads."""

from __future__ import annotations

import pytest

from trainforge.approval import (
    APPROVE,
    APPROVED,
    REJECT,
    REJECTED,
    TAG_AT,
    TAG_BY,
    TAG_DAG_RUN,
    TAG_HISTORY,
    TAG_REASON,
    TAG_STATUS,
    TAG_TRY,
    outcome_of,
    promotion_refusal,
    request_body,
    with_history,
)

AT = "2026-12-01T10:00:00+00:00"
ALICE = {"id": "alice", "name": "Alice"}


@pytest.mark.parametrize(("chosen", "params", "by", "timed_out", "expected"), [
    ([APPROVE], {"reason": " looks good "}, ALICE, False, (APPROVED, "alice", "looks good", True)),
    ([REJECT], {"reason": "worse on dialogue"}, ALICE, False,
     (REJECTED, "alice", "worse on dialogue", False)),
    ([REJECT], {}, ALICE, False, (REJECTED, "alice", "", False)),
    # Airflow's timeout sweep writes the default (Reject) with nobody as the responder.
    ([REJECT], {"reason": ""}, None, True,
     (REJECTED, None, "no answer within 2h (registry.approval.on_timeout: reject)", False)),
])
def test_an_answer_decides_the_outcome(chosen, params, by, timed_out, expected):
    outcome = outcome_of(chosen, params, by, AT, timed_out, 7200)
    assert (outcome.status, outcome.by, outcome.reason, outcome.promote) == expected
    assert outcome.timed_out is timed_out
    assert outcome.tags()[TAG_STATUS] == expected[0]
    assert outcome.tags()[TAG_BY] == (expected[1] or "none")
    assert outcome.tags()[TAG_REASON] == (expected[2] or "none")


def test_a_timeout_never_promotes_even_if_the_default_were_approve():
    assert not outcome_of([APPROVE], {}, None, AT, True, 60).promote


@pytest.mark.parametrize("chosen", [[], ["Maybe"], [APPROVE, REJECT]])
def test_an_unknown_answer_is_refused(chosen):
    with pytest.raises(ValueError, match="an approval answer is one of"):
        outcome_of(chosen, {}, ALICE, AT, False, 60)


def test_the_request_shows_candidate_and_champion_thresholds_card_and_links():
    gate = {"decision": "pass", "reason": "val_bits_per_byte 2.1000 vs champion 2.4000",
            "metric": "val_bits_per_byte", "method": "tokens", "candidate_version": "7",
            "candidate_value": 2.1, "champion_version": "5", "champion_value": 2.4,
            "improvement": 0.125, "min_improvement": 0.01}
    body = request_body(
        gate=gate,
        thresholds={"validation.max_val_loss": 3.5, "validation.gate.min_improvement": 0.01},
        model_card="# tiny\n\n- dataset digest: `abc`",
        links={"MLflow run": "http://mlflow/#/experiments/1/runs/r", "Airflow DAG run": ""},
        timeout_s=86400, on_timeout="reject")
    assert "| candidate | v7 | 2.1000 |" in body and "| champion | v5 | 2.4000 |" in body
    assert "relative improvement +12.50%" in body and "same validation split" in body
    assert "- `validation.max_val_loss`: 3.5000" in body
    assert "> # tiny" in body and "> - dataset digest: `abc`" in body
    assert "- [MLflow run](http://mlflow/#/experiments/1/runs/r)" in body
    assert "Airflow DAG run" not in body  # an empty link is left out
    assert "Approve to move `champion` to v7; reject to keep v5." in body
    assert "Without an answer within 1d the request is rejected." in body


def test_the_first_model_has_no_champion_to_show():
    gate = {"reason": "first version", "metric": "val_bits_per_byte", "method": "thresholds",
            "candidate_version": "1", "candidate_value": 2.5, "champion_version": None,
            "champion_value": None, "improvement": None}
    body = request_body(gate=gate, thresholds={}, model_card="", links={}, timeout_s=60,
                        on_timeout="fail")
    assert "reject to keep no champion" in body and "| champion | — | — |" in body
    assert "fails the task; champion stays" in body


def _decision(status: str, by: str = "alice", reason: str = "ok") -> dict[str, str]:
    return {TAG_STATUS: status, TAG_BY: by, TAG_REASON: reason, TAG_AT: AT,
            TAG_DAG_RUN: "p/manual__1", TAG_TRY: "1"}


def test_a_decision_is_added_to_the_history_and_pending_leaves_it_alone():
    first = with_history(_decision("approved"), None)
    line = f"{AT} approved by alice in p/manual__1 try 1: ok"
    assert first[TAG_HISTORY] == line
    again = with_history(_decision("rejected", reason="worse\non dialogue"), first[TAG_HISTORY])
    assert again[TAG_HISTORY].splitlines() == [
        line, f"{AT} rejected by alice in p/manual__1 try 1: worse on dialogue"]
    pending = with_history(_decision("pending"), again[TAG_HISTORY])
    assert TAG_HISTORY not in pending  # the recorded decisions are not overwritten


def test_the_history_drops_its_oldest_lines_past_mlflows_tag_limit():
    history = None
    for n in range(100):
        history = with_history(_decision("rejected", reason=f"take {n} " + "x" * 80),
                               history)[TAG_HISTORY]
    assert len(history) <= 5000
    assert "take 99 " in history.splitlines()[-1] and "take 0 " not in history


PENDING_HERE = {TAG_STATUS: "pending", TAG_DAG_RUN: "p/manual__1", TAG_TRY: "2"}


@pytest.mark.parametrize(("states", "tags", "fragment"), [
    ({"validate_checkpoint": "success", "register_model": "success"}, PENDING_HERE, None),
    ({"validate_checkpoint": "failed", "register_model": "success"}, PENDING_HERE,
     "validate_checkpoint is failed in this DAG run (p/manual__1)"),
    ({"validate_checkpoint": "none", "register_model": "upstream_failed"}, PENDING_HERE,
     "register_model is upstream_failed, validate_checkpoint is none"),
    ({"validate_checkpoint": "success"}, {**PENDING_HERE, TAG_TRY: "1"},
     "not pending for p/manual__1 try 2"),  # an answer to an older try's request
    ({"validate_checkpoint": "success"}, {**PENDING_HERE, TAG_STATUS: "cancelled"},
     "status cancelled"),
    ({"validate_checkpoint": "success"}, {**PENDING_HERE, TAG_DAG_RUN: "p/manual__0"},
     "asked by p/manual__0 try 2"),
])
def test_champion_moves_only_with_upstream_success_and_this_trys_request(states, tags, fragment):
    refusal = promotion_refusal(version="3", upstream_states=states, tags=tags,
                                dag_run="p/manual__1", try_number=2)
    if fragment is None:
        assert refusal is None
    else:
        assert fragment in refusal
