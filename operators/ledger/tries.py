"""The ``train`` task's try records (MLflow tags ``trainforge.ledger.try.<n>``): what the
trainer's attempt records cannot know.

A try is one run of the Airflow task; it launches (or adopts) one engine job, in which one or
more trainer attempts run. Rank 0's attempt record (trainforge.trainer.goodput) stops at its last
flush; a killed attempt's remaining time, up to the kill, and the time the task spent before its
job started are known only to the orchestrator. So each try writes, when it has its job
(:func:`try_started`) and again at its outcome (:func:`try_ended`)::

    {"try": n, "task_started_at": s, "submitted_at": s | null, "submitted_by_this_try": bool,
     "job": key, "job_ended_at": s | null, "job_wall_s": s | null,
     "phases": {"queue_wait": s, "image_pull": s}, "ended_at": s | null, "outcome": str | null,
     "disruption": {"kind": "node_loss", "node": str, "detection_s": s, ...},  # when known
     "oom": {"rank", "step", "phase", "micro_batch_size", "next_micro_batch_size", ...},  # idem
     "root_cause": {"how", "culprits", "collateral"}, "repeats": n,  # idem (trainforge.repeated_failure)
     "restarts": [{"kind": "restart", "index", "node", "rank", "cause", "lost_at", ...}]}  # in-job

The ledger (trainforge.ledger.build) opens its window at the earliest try's start, so every
attempt of every try, and everything between them, is in one window: goodput's wall time, and the
GPU-hours, energy and cost billed over it.
"""

from __future__ import annotations

import json
from typing import Any

from trainforge.ledger.disruptions import event_disruption
from trainforge.ledger.names import OOM_COUNT, OOM_TAG

TRY_TAG_PREFIX = "trainforge.ledger.try."


class TryRecordError(ValueError):
    """A try record tag that is not this module's JSON."""


def try_tag(try_number: int) -> str:
    """The MLflow tag of try ``try_number``'s record."""
    return f"{TRY_TAG_PREFIX}{int(try_number)}"


def try_started(try_number: int, task_started_s: float | None, handle: dict[str, Any]) -> dict[str, Any]:
    """A try's record once it has its job (launched, or adopted from an earlier try)."""
    identity = handle.get("identity") or {}
    return {"try": int(try_number), "task_started_at": task_started_s,
            "submitted_at": handle.get("submitted_at_epoch_s"),
            "submitted_by_this_try": int(identity.get("try_number") or 0) == int(try_number),
            "job": handle.get("key"), "job_ended_at": None, "job_wall_s": None, "phases": {},
            "ended_at": None, "outcome": None}


def try_ended(record: dict[str, Any] | None, try_number: int, task_started_s: float | None,
              event: dict[str, Any], now_s: float) -> dict[str, Any]:
    """The try's record at its outcome (``event``: the trigger's event): the job's end, its wall
    time and the engine's phases (those known, in seconds)."""
    out = dict(record or try_started(try_number, task_started_s, event.get("handle") or {}))
    if out.get("task_started_at") is None:
        out["task_started_at"] = task_started_s
    phases = event.get("phases") or {}
    out.update(job_ended_at=event.get("ended_at_epoch_s"), job_wall_s=event.get("wall_s"),
               phases={k: float(v) for k, v in phases.items() if isinstance(v, (int, float))},
               ended_at=now_s, outcome=str(event.get("status")))
    disruption = event_disruption(event)
    if disruption is not None:  # e.g. the node a node_loss took (trainforge.ledger.disruptions)
        out["disruption"] = disruption
    if event.get("oom"):  # a GPU out of memory and the retry's micro-batch (trainforge.oom_retry)
        out["oom"] = event["oom"]
    cause = (event.get("result") or {}).get("root_cause")
    if isinstance(cause, dict):  # the rank that started the failure (trainforge.engines.root_cause)
        out["root_cause"] = {**cause, "culprits": [{**c, "message": str(c.get("message") or "")[:300]}
                                                   for c in cause.get("culprits") or [] if isinstance(c, dict)]}
    restarts = (event.get("result") or {}).get("restarts")
    if isinstance(restarts, list) and restarts:  # in-job restarts (trainforge.engines.root_cause)
        out["restarts"] = restarts
    if event.get("repeats"):  # the try whose failure this one repeated (trainforge.repeated_failure)
        out["repeats"] = event["repeats"]
    return out


def oom_figures(tries: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags) of the tries that ran out of GPU memory: how many, and each one's rank,
    step, phase and micro-batch, then the retry's (JSON); both empty when none did."""
    ooms = [{"try": t.get("try"), **t["oom"]} for t in tries if t.get("oom")]
    if not ooms:
        return {}, {}
    keys = ("try", "rank", "step", "phase", "micro_batch_size", "next_micro_batch_size")
    return ({OOM_COUNT: float(len(ooms))},
            {OOM_TAG: json.dumps([{k: o.get(k) for k in keys} for o in ooms], separators=(",", ":"))})


def try_records(tags: dict[str, str]) -> dict[int, dict[str, Any]]:
    """The run's try records by try number.

    Raises:
        TryRecordError: a try tag does not hold a JSON object with ``try`` (names the tag).
    """
    found = {}
    for key, value in tags.items():
        if not key.startswith(TRY_TAG_PREFIX):
            continue
        try:
            record = json.loads(value)
        except json.JSONDecodeError as err:
            raise TryRecordError(f"tag {key}: not JSON ({err}): {value[:200]!r}") from err
        if not isinstance(record, dict) or "try" not in record:
            raise TryRecordError(f"tag {key}: expected a try record (an object with try), got "
                                 f"{value[:200]!r}")
        found[int(record["try"])] = record
    return found


def earlier_tries(tags: dict[str, str], try_number: int) -> list[dict[str, Any]]:
    """The records of the tries before ``try_number``, oldest first."""
    found = try_records(tags)
    return [found[k] for k in sorted(found) if k < try_number]


def encode(record: dict[str, Any]) -> str:
    """A try record as its tag's value."""
    return json.dumps(record, separators=(",", ":"))
