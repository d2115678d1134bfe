"""What the engines add to a job's status from the ranks' own records: a failed job's message names
the rank that started it (trainforge.trainer.causes), and the result lists the job's in-job
restarts (trainforge.trainer.restarts). docs/faults.md, "Who failed" and "One restart budget".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainforge.contract import PERMANENT_RESULTS, RESTARTS_FILE
from trainforge.trainer.causes import describe, root_cause, summary

__all__ = ["restarts", "root_cause", "tell", "told", "with_restarts"]


def told(folder: str | Path, message: str, result: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    """:func:`tell` the root cause of the ranks' records under ``folder`` (the job folder)."""
    return tell(root_cause(folder), message, result)


def tell(cause: dict[str, Any] | None, message: str, result: dict[str, Any] | None
         ) -> tuple[str, dict[str, Any] | None]:
    """A failed job's ``(message, result)`` with the rank that started it (``cause``): named first
    (rank 0's own message after it) unless the trainer's verdict is permanent (a bad config,
    divergence, out of memory: the message already says why); ``result["root_cause"]`` either way."""
    if cause is None:
        return message, result
    said = (result or {}).get("message")
    result = {**(result or {}), "root_cause": summary(cause)}
    if result.get("status") in PERMANENT_RESULTS:
        return message, result
    if said != message:  # no result: the engine's own words
        return f"{describe(cause)}\n  ({message})", result
    rank0 = next((r for r in cause["collateral"] if r["rank"] == 0), None)
    if rank0 is not None and rank0.get("how") == "waited":  # its words are in the collateral line
        return describe(cause), result
    return f"{describe(cause)}\n  rank 0 said: {said}", result


def restarts(folder: str | Path) -> list[dict[str, Any]]:
    """The job's in-job restarts from ``folder``/restarts.json, each a ``restart`` disruption
    (trainforge.ledger.disruptions): ``index``, the culprit's ``node`` and ``rank``, ``cause``
    (one line), ``lost_at`` (the failure), ``detected_at`` (the restart's start) and
    ``detection_s``; empty when the job did not restart or the file is unreadable."""
    try:
        attempts = json.loads(Path(folder, RESTARTS_FILE).read_text(encoding="utf-8"))["attempts"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    out = []
    for a in attempts if isinstance(attempts, list) else []:
        if not isinstance(a, dict) or not isinstance(a.get("index"), int) or a["index"] < 1:
            continue
        culprit = ((a.get("after") or {}).get("culprits") or [{}])[0]
        lost, started = a.get("failed_at"), a.get("started_at")
        out.append({"kind": "restart", "index": a["index"], "node": culprit.get("host"), "rank": culprit.get("rank"),
                    "cause": a.get("cause"), "lost_at": lost, "detected_at": started,
                    "detection_s": round(started - lost, 3) if isinstance(lost, (int, float))
                    and isinstance(started, (int, float)) else None})
    return out


def with_restarts(folder: str | Path, result: dict[str, Any] | None) -> dict[str, Any] | None:
    """``result`` with ``restarts`` (:func:`restarts`) when the job restarted."""
    found = restarts(folder)
    return {**(result or {}), "restarts": found} if found else result
