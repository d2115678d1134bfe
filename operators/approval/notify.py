"""Sending a posted approval request to approvers (``registry.approval.notify``).

Each notifier is an Airflow notifier (the SMTP provider's ``SmtpNotifier``) run in its own
thread and given its own timeout: a notifier that raises or outlasts its timeout is logged and
left behind. Nothing here answers the request, rejects it or fails the task; the request's
window (``registry.approval.timeout``) counts from when it was posted, so the time the
notifiers took is taken off the wait (:func:`remaining_timeout`).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: The shortest wait left after the notifiers, so a request is never parked already expired.
MIN_WAIT_S = 1.0


@dataclass(frozen=True)
class TimedNotifier:
    """One notifier with its name (for the log) and how long it may take, in seconds."""

    name: str
    notify: Callable[[Any], Any]  # an Airflow notifier: called with the task context
    timeout_s: float


def run_notifiers(notifiers: list[TimedNotifier], context: Any) -> dict[str, str]:
    """Run every notifier, each cut at its own timeout; ``{name: "sent" | "failed" | "timed out"}``.

    Notifiers run one after another, each in a daemon thread that is abandoned (and logged) when
    it outlasts its timeout. An exception is logged with its traceback, never raised.
    """
    results: dict[str, str] = {}
    for notifier in notifiers:
        outcome: dict[str, BaseException] = {}

        def send(n: TimedNotifier = notifier, out: dict = outcome) -> None:
            try:
                n.notify(context)
            except BaseException as exc:  # noqa: BLE001 - a notifier never fails the gate
                out["error"] = exc

        thread = threading.Thread(target=send, name=f"approval-notify-{notifier.name}",
                                  daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(notifier.timeout_s)
        if thread.is_alive():
            results[notifier.name] = "timed out"
            log.warning("approval notifier %s did not finish within %ss: given up; the request "
                        "waits for its answer all the same", notifier.name, notifier.timeout_s)
        elif "error" in outcome:
            results[notifier.name] = "failed"
            error = outcome["error"]
            log.warning("approval notifier %s failed (%s: %s); the request waits for its answer "
                        "all the same", notifier.name, type(error).__name__, error,
                        exc_info=(type(error), error, error.__traceback__))
        else:
            results[notifier.name] = "sent"
            log.info("approval notifier %s sent the request in %.1fs", notifier.name,
                     time.monotonic() - started)
    return results


def remaining_timeout(timeout_s: float, posted_monotonic: float,
                      now_monotonic: float | None = None) -> dt.timedelta:
    """The wait left of a request's window that started at ``posted_monotonic``
    (``time.monotonic()`` when it was posted); at least :data:`MIN_WAIT_S`."""
    now = time.monotonic() if now_monotonic is None else now_monotonic
    return dt.timedelta(seconds=max(MIN_WAIT_S, timeout_s - (now - posted_monotonic)))


def email_notifier(*, to: list[str], conn_id: str, timeout_s: float, subject: str,
                   html: str) -> TimedNotifier:
    """The SMTP provider's ``SmtpNotifier`` for ``registry.approval.notify.email``."""
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    notifier = SmtpNotifier(to=list(to), subject=subject, html_content=html,
                            smtp_conn_id=conn_id)
    # notify(), not the notifier's __call__: the request's text is sent as written, never
    # rendered as a Jinja template (a model card may hold "{{").
    return TimedNotifier(f"email ({conn_id})", notifier.notify, float(timeout_s))


def request_html(body: str, answer_url: str | None) -> str:
    """The mail's HTML: where to answer, then the request's Markdown as preformatted text."""
    import html

    link = (f'<p>Answer in Airflow: <a href="{html.escape(answer_url)}">'
            f"{html.escape(answer_url)}</a></p>\n" if answer_url else "")
    return f"{link}<pre>{html.escape(body)}</pre>"


def notifiers_for(notify: dict[str, Any] | None, *, subject: str, html: str) -> list[TimedNotifier]:
    """The notifiers of a ``registry.approval.notify`` block (as the spec's JSON dump)."""
    from trainforge.pipeline.durations import parse_duration

    notifiers = []
    email = (notify or {}).get("email")
    if email:  # the dump writes durations as the spec does ("30s")
        notifiers.append(email_notifier(to=email["to"], conn_id=email["conn_id"],
                                        timeout_s=parse_duration(email["timeout"]),
                                        subject=subject, html=html))
    return notifiers
