"""The pure part of human approval (trainforge.approval): what an answer decides, and the
request a person reads."""

from __future__ import annotations

import pytest

from trainforge.approval import (
    APPROVE,
    APPROVED,
    REJECT,
    REJECTED,
    TAG_BY,
    TAG_REASON,
    TAG_STATUS,
    outcome_of,
    request_body,
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
