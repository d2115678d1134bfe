"""``registry.approval`` and ``pipeline.deadline`` in the spec: defaults, and each bad value
as a spec error at its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainforge.pipeline import SpecError, parse_spec_text

BASE = (Path(__file__).resolve().parents[2] / "faults" / "fault_tiny.yaml").read_text()
MAIL = "  notifications:\n    email:\n      to: [ml-platform@example.org]\n"


def _spec(approval: str = "", pipeline: str = "", validation: str = ""):
    text = BASE.replace("  aliases: [challenger]\n", "  aliases: [challenger]\n" + approval)
    text = text.replace("  schedule: null\n", "  schedule: null\n" + pipeline)
    text = text.replace("validation:\n", "validation:\n" + validation)
    return parse_spec_text(text, "p.yaml")


def test_defaults_reject_after_a_week_and_let_the_auth_manager_choose():
    approval = _spec("  approval: {}\n").registry.approval
    assert (approval.approvers, approval.timeout, approval.on_timeout) == (
        None, 7 * 86400, "reject")
    assert _spec().registry.approval is None and _spec().pipeline.deadline is None


def test_a_full_block_and_a_deadline():
    spec = _spec("  approval:\n    approvers: [alice, bob@example.org]\n    timeout: 1h30m\n"
                 "    on_timeout: fail\n", "  deadline: 2h\n" + MAIL)
    assert spec.registry.approval.approvers == ["alice", "bob@example.org"]
    assert (spec.registry.approval.timeout, spec.registry.approval.on_timeout) == (5400, "fail")
    assert spec.pipeline.deadline == 7200


def test_notify_mails_through_smtp_default_within_30s_unless_told():
    spec = _spec("  approval:\n    notify:\n      email:\n        to: [a@example.org]\n")
    email = spec.registry.approval.notify.email
    assert (email.to, email.conn_id, email.timeout) == (["a@example.org"], "smtp_default", 30)
    assert _spec("  approval: {}\n").registry.approval.notify is None


@pytest.mark.parametrize(("approval", "pipeline", "validation", "where", "fragment"), [
    ("  approval:\n    approvers: []\n", "", "", "p.yaml:54:", "an empty list lets nobody answer (got []"),
    ("  approval:\n    approvers: [alice, alice]\n", "", "", "registry.approval.approvers",
     "approver 'alice' is listed twice"),
    ("  approval:\n    approvers: ['']\n", "", "", "registry.approval.approvers",
     "may not be empty"),
    ("  approval:\n    approvers: [' alice']\n", "", "", "registry.approval.approvers",
     "has spaces around it"),
    ("  approval:\n    timeout: 5\n", "", "", "p.yaml:54:14: registry.approval.timeout",
     "a duration is a string"),
    ("  approval:\n    timeout: 0s\n", "", "", "registry.approval.timeout", "longer than zero"),
    ("  approval:\n    on_timeout: approve\n", "", "", "registry.approval.on_timeout",
     "expected 'reject' or 'fail'"),
    ("  approval:\n    approver: [alice]\n", "", "", "registry.approval.approver",
     "unknown field"),
    ("  approval: yes\n", "", "", "registry.approval", ""),
    ("  approval:\n", "", "", "p.yaml:53:12: registry.approval", "empty (got nothing after 'approval:'"),
    ("  approval: {}\n", "", "  gate:\n    enabled: false\n", "p.yaml:55:3: registry.approval",
     "validation.gate.enabled is false"),
    ("", "  deadline: soon\n" + MAIL, "", "p.yaml:7:13: pipeline.deadline", "not a duration"),
    ("", "  deadline: 0s\n" + MAIL, "", "pipeline.deadline", "longer than zero"),
    ("", "  deadline: 2h\n", "", "p.yaml:7:13: pipeline.deadline",
     "notifies through pipeline.notifications, but none is set"),
    ("  approval:\n    notify:\n      email:\n        to: [approvers]\n", "", "",
     "p.yaml:56:9: registry.approval.notify.email.to", "not an email address (got 'approvers')"),
    ("  approval:\n    notify:\n      email:\n        to: []\n", "", "",
     "registry.approval.notify.email.to", ""),
    ("  approval:\n    notify:\n      email:\n        to: [a@example.org]\n"
     "        timeout: 0s\n", "", "", "p.yaml:57:18: registry.approval.notify.email.timeout",
     "longer than zero"),
    ("  approval:\n    notify:\n      slack: {channel: '#ml'}\n", "", "",
     "registry.approval.notify.slack", "unknown field"),
    ("  approval:\n    notify:\n      email:\n        to: [a@example.org]\n"
     "        conn_id: 'smtp://user:pw@mail.example.com:587'\n", "", "",
     "registry.approval.notify.email.conn_id", "not an Airflow connection id"),
])
def test_bad_values_are_spec_errors_at_their_line(approval, pipeline, validation, where,
                                                  fragment):
    with pytest.raises(SpecError) as err:
        _spec(approval, pipeline, validation)
    assert where in str(err.value) and fragment in str(err.value)
