"""A retry that raises the same exception at the same line is a deterministic failure: not retried
again (docs/faults.md, "Failure classes").

A job whose rank raised a Python exception fails transient the first time: a flaky read, a
host's bad disk or a race may not happen again. The try record keeps the job's root cause
(trainforge.engines.root_cause): the exception's class and its origin, the innermost frame. When
the retry's job fails with the same exception raised at the same origin, a third try would only
repeat it: that failure is permanent, and says which try it repeats. A node loss, a transport
error seen by a rank that waited, an OOM kill or a hang has no such signature and is retried as
before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trainforge.ledger.tries import TryRecordError, earlier_tries


def signature(cause: Any) -> tuple[str, str] | None:
    """``(exception, origin)`` of the rank that raised first in a root cause (the result's
    ``root_cause``, or a try record's), or None when no rank raised or its origin is unknown."""
    if not isinstance(cause, dict) or cause.get("how") != "raised" or not cause.get("culprits"):
        return None
    first = cause["culprits"][0]
    if not isinstance(first, dict) or not first.get("exception") or not first.get("origin"):
        return None
    return str(first["exception"]), str(first["origin"])


def repeated(event: dict[str, Any], tags: Callable[[], dict[str, str]], try_number: int,
             log: logging.Logger) -> dict[str, Any]:
    """The event, permanent with ``repeats``: the try number it repeats, when its job failed
    transient with a rank that raised the same exception at the same origin as the job of the try
    before it (``tags()``: the run's tags, which hold the try records); else unchanged."""
    mine = signature((event.get("result") or {}).get("root_cause"))
    if event.get("status") != "error" or event.get("failure") == "permanent" or mine is None or try_number <= 1:
        return event
    try:
        before = earlier_tries(tags(), try_number)
    except TryRecordError as err:
        log.warning("could not read the earlier tries' records (%s): the failure stays transient", err)
        return event
    except Exception:  # noqa: BLE001 - MLflow unreachable: retrying is what happened before
        log.warning("could not read the earlier tries' records: the failure stays transient", exc_info=True)
        return event
    if not before or signature(before[-1].get("root_cause")) != mine:
        return event
    previous = before[-1].get("try")
    exception, origin = mine
    return {**event, "failure": "permanent", "repeats": previous,
            "message": f"{event['message']}\n  try {try_number} raised the same {exception} at {origin} as try "
                       f"{previous}: a deterministic failure, not retried again"}
