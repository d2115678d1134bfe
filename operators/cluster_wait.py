"""The wait of a cluster job's task (trainforge.cluster_job): its deadline across deferral,
the check of the trigger's event, and the exception that ends a wait in the worker slot on
SIGTERM. How they are used: docs/faults.md, "The launch, inside".
"""

from __future__ import annotations

from typing import Any

from trainforge.errors import TriggerEventError
from trainforge.triggers import EVENT_STATUSES

# Seconds the trigger's own deadline comes before Airflow's trigger timeout (plus one poll), so
# that the trigger's ``timeout`` event — which cancels the job and says why — wins the race.
DEADLINE_MARGIN_S = 5.0


def wait_deadline(
    *,
    now_s: float,
    job_submitted_s: float | None,
    run_timeout_s: float,
    task_started_s: float | None,
    execution_timeout_s: float | None,
    poll_interval_s: float,
) -> tuple[float, str, float]:
    """The deferred wait's deadline: ``(trigger deadline epoch s, reason, defer timeout s)``.

    The job may run ``run_timeout_s`` from its submission (``job_submitted_s``; ``now_s`` when
    unknown); the task may run ``execution_timeout_s`` from its first start (``task_started_s``).
    The earlier limit wins and names the ``reason`` (``"run_timeout"`` or
    ``"execution_timeout"``). The defer timeout is the time left to that limit (at least 1 s);
    the trigger deadline comes ``poll_interval_s + DEADLINE_MARGIN_S`` earlier, but never
    before ``now_s``.
    """
    limit, reason = (job_submitted_s or now_s) + run_timeout_s, "run_timeout"
    if execution_timeout_s is not None:
        task_limit = (task_started_s or now_s) + execution_timeout_s
        if task_limit < limit:
            limit, reason = task_limit, "execution_timeout"
    left = max(1.0, limit - now_s)
    trigger_deadline = max(now_s, limit - poll_interval_s - DEADLINE_MARGIN_S)
    return trigger_deadline, reason, left


class TaskProcessTerminated(BaseException):
    """The task process got SIGTERM while it waited on its job in the worker slot.

    A ``BaseException``, like Airflow's ``AirflowTaskTimeout``: raised from a signal handler, it
    must pass through the event loop of the wait (asyncio logs and swallows an ``Exception``
    raised inside a callback). Airflow's task runner records it as a failure, retried when
    retries are left (a worker shutdown is transient); the retry resumes or adopts the job.
    """


def validate_event(event: Any) -> dict[str, Any]:
    """Check a trigger event's shape before acting on it.

    Raises:
        TriggerEventError: not a dict, or ``status`` outside :data:`EVENT_STATUSES`, or no message.
    """
    if not isinstance(event, dict):
        raise TriggerEventError(f"trigger event must be a dict (got {type(event).__name__})")
    status = event.get("status")
    if status not in EVENT_STATUSES:
        raise TriggerEventError(
            f"trigger event status {status!r} is not one of {', '.join(EVENT_STATUSES)}"
        )
    if not isinstance(event.get("message"), str) or not isinstance(event.get("handle"), dict):
        raise TriggerEventError(f"trigger event lacks a message or job handle: {event!r}")
    return event
