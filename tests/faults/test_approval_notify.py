"""``registry.approval.notify`` (trainforge.approval.notify): the posted request goes out through
the SMTP provider's notifier to the session's SMTP sink; a notifier that fails or hangs is logged
and cut at its own timeout, never an answer; the approval task still parks for its answer, with
the wait counted from when the request was posted.

No Airflow server: the notifiers run in this process (the SMTP connection from
``AIRFLOW_CONN_SMTP_DEFAULT``), and the request's posting (``upsert_hitl_detail``) is recorded
instead of sent to an API server.
"""

from __future__ import annotations

import logging
import socket
import time
from email import message_from_string, policy
from pathlib import Path

import pytest
from airflow.sdk.exceptions import TaskAwaitingInput

from trainforge.approval.notify import (
    TimedNotifier,
    notifiers_for,
    remaining_timeout,
    request_html,
    run_notifiers,
)

SPEC = Path(__file__).resolve().parent / "approval_tiny.yaml"
SUBJECT = "Promote approval-tiny v7 to champion?"
BODY = "The eval gate passed v7: better.\n\n| candidate | v7 | 1.2345 |\n> <b>card</b> {{ x }}"


def _email(conn_id: str, timeout: str) -> dict:
    """``registry.approval.notify`` as the DAG builder hands it over (the spec's JSON dump)."""
    from trainforge.pipeline.approval import ApprovalNotify

    return ApprovalNotify.model_validate({"email": {
        "to": ["approvers@example.org"], "conn_id": conn_id, "timeout": timeout}}
    ).model_dump(mode="json")


@pytest.fixture
def silent_smtp(monkeypatch):
    """An SMTP connection ``smtp_silent`` to a server that accepts and never greets."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    monkeypatch.setenv("AIRFLOW_CONN_SMTP_SILENT", (
        '{"conn_type": "smtp", "host": "127.0.0.1", "port": %d, "extra": {"disable_tls": true, '
        '"disable_ssl": true, "from_email": "airflow@example.org", "timeout": 120}}'
        % server.getsockname()[1]))
    yield "smtp_silent"
    server.close()


def _mails(sink) -> list:
    mails = [message_from_string(m, policy=policy.default) for m in sink.messages]
    return [m for m in mails if m["Subject"] == SUBJECT]


def test_the_request_is_mailed_as_written_through_smtp(smtp_sink, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_SMTP_DEFAULT", smtp_sink.connection())
    before = len(_mails(smtp_sink))
    notifiers = notifiers_for(_email("smtp_default", "20s"), subject=SUBJECT,
                              html=request_html(BODY, "http://airflow/required_actions?x=1&y=2"))
    assert run_notifiers(notifiers, {}) == {"email (smtp_default)": "sent"}
    mail = _mails(smtp_sink)[before]
    assert mail["To"] == "approvers@example.org"
    html = mail.get_body(("html",)).get_content()
    assert 'href="http://airflow/required_actions?x=1&amp;y=2"' in html
    # Escaped, and not rendered as a Jinja template.
    assert "| candidate | v7 | 1.2345 |" in html and "&lt;b&gt;card&lt;/b&gt; {{ x }}" in html


def test_a_hanging_notifier_is_cut_at_its_timeout(silent_smtp, caplog):
    [notifier] = notifiers_for(_email(silent_smtp, "1s"), subject=SUBJECT, html="x")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainforge.approval.notify"):
        assert run_notifiers([notifier], {}) == {f"email ({silent_smtp})": "timed out"}
    assert time.monotonic() - started < 10  # the connection's own timeout is 120 s
    assert "did not finish within 1.0s" in caplog.text


def test_a_failing_notifier_is_logged_and_the_next_one_still_runs(caplog):
    sent = []

    def broken(context):
        raise ConnectionRefusedError("no SMTP server")

    notifiers = [TimedNotifier("broken", broken, 5), TimedNotifier("ok", sent.append, 5)]
    with caplog.at_level(logging.WARNING, logger="trainforge.approval.notify"):
        assert run_notifiers(notifiers, {"k": 1}) == {"broken": "failed", "ok": "sent"}
    assert sent == [{"k": 1}]
    assert "approval notifier broken failed (ConnectionRefusedError: no SMTP server)" in caplog.text


def test_the_window_counts_from_the_posting():
    assert remaining_timeout(3600, 100.0, now_monotonic=130.0).total_seconds() == 3570
    # Never parked already expired: at least a second is left to answer in.
    assert remaining_timeout(20, 0.0, now_monotonic=60.0).total_seconds() == 1.0


def test_the_gate_parks_for_its_answer_after_a_hanging_notifier(silent_smtp, monkeypatch):
    """HITLOperator.execute as approve_champion runs it: posted, notified, parked."""
    from airflow.providers.standard.operators import hitl

    from trainforge.pipeline.loader import load_spec
    from trainforge.tasks.approve_champion import ApproveChampionOperator

    posted = []
    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **request: posted.append(request))
    op = ApproveChampionOperator(task_id="approve_champion",
                                 spec=load_spec(SPEC).model_dump(mode="json"),
                                 approvers=["admin"], timeout_s=3600, on_timeout="reject",
                                 notify=_email(silent_smtp, "1s"))
    op.subject, op.body = SUBJECT, BODY
    op.notifiers = [op._notify_approvers]
    op._posted = time.monotonic() - 30  # the request was posted 30 s ago

    class TI:
        id, dag_id, run_id, map_index = "ti-1", "approval_tiny", "r1", -1
        task_id = "approve_champion"

    started = time.monotonic()
    with pytest.raises(TaskAwaitingInput) as parked:
        hitl.HITLOperator.execute(op, {"task_instance": TI(), "ti": TI()})
    assert time.monotonic() - started < 10
    assert [p["subject"] for p in posted] == [SUBJECT]
    assert parked.value.method_name == "execute_complete"
    assert 3560 <= parked.value.timeout.total_seconds() <= 3570
