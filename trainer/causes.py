"""The rank that started a failed attempt, from the ranks' own records (trainforge.trainer.rank_record).

torchrun's summary, and rank 0's result, tell the failure as whichever rank noticed it first: a
peer's "Connection closed by peer" or a collective that timed out. Each rank records how it
started and ended; of the newest record of each rank:

* the first to have **raised** an exception of its own started it (its traceback's last lines);
* else, when some ranks **waited** (their collective failed) and others never recorded an end or
  were **terminated**, those others stopped making progress: a hang, a stop, a kill;
* the rest are collateral: they waited on it, or were torn down.

A node that went down leaves ranks without an end too; the engines name a lost node from the
scheduler first (trainforge.engines.slurm.node_loss, ray.node_loss). The engines tell it in a
failed job's message (trainforge.engines.root_cause); rank 0 of a restarted attempt names the
cause of the restart (trainforge.trainer.restarts). Stdlib only. docs/faults.md, "Who failed".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainforge.contract import RANK_RECORDS_DIR


def rank_records(folder: str | Path, job_restart: int | None = None) -> list[dict[str, Any]]:
    """The newest record of each rank under ``folder``/rank_records (unreadable ones left out);
    with ``job_restart``, of that attempt of the job only (trainforge.trainer.restarts)."""
    return newest([record for _, record in _read(folder)], job_restart)


def last_alive(folder: str | Path, host: str) -> float | None:
    """The last sign of life of ``host``'s ranks under ``folder``/rank_records: the newest
    modification time of their records (a training rank renews its own every second or so,
    trainforge.trainer.rank_record.RankRecord.alive); None when it has none."""
    times = []
    for path, record in _read(folder):
        try:
            if isinstance(record, dict) and record.get("host") == host:
                times.append(path.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=None)


def _read(folder: str | Path) -> list[tuple[Path, Any]]:
    """``(path, parsed JSON)`` of each record file under ``folder``/rank_records, by name;
    unreadable ones left out."""
    found = []
    for path in sorted(Path(folder, RANK_RECORDS_DIR).glob("rank-*.json")):
        try:
            found.append((path, json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue
    return found


def newest(records: list[Any], job_restart: int | None = None) -> list[dict[str, Any]]:
    """The newest of ``records`` for each rank (by ``started_at``), by rank; malformed ones left
    out; with ``job_restart``, of that attempt of the job only."""
    by_rank: dict[int, dict[str, Any]] = {}
    for record in records:
        try:
            rank, started = int(record["rank"]), float(record["started_at"])
        except (ValueError, KeyError, TypeError):
            continue
        if job_restart is not None and record.get("job_restart") != job_restart:
            continue
        if rank not in by_rank or started > float(by_rank[rank]["started_at"]):
            by_rank[rank] = record
    return [by_rank[r] for r in sorted(by_rank)]


def root_cause(folder: str | Path, job_restart: int | None = None) -> dict[str, Any] | None:
    """:func:`cause_of` the last attempt under ``folder`` (or attempt ``job_restart``)."""
    return cause_of(rank_records(folder, job_restart))


def cause_of(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``{"culprits": [records], "how": "raised" | "stopped", "collateral": [records]}`` of one
    attempt's newest records (:func:`newest`); None when they do not single anything out."""
    raised = sorted((r for r in records if r.get("how") == "raised"), key=lambda r: r.get("ended_at") or 0.0)
    if raised:
        first = raised[0]
        return {"how": "raised", "culprits": [first], "collateral": [r for r in records if r is not first]}
    waited = [r for r in records if r.get("how") == "waited"]
    silent = [r for r in records if r.get("how") in (None, "terminated")]
    if waited and silent:
        return {"how": "stopped", "culprits": silent, "collateral": waited}
    return None


def where(record: dict[str, Any]) -> str:
    """``rank 1 on host-b (10.0.0.2)``."""
    address = f" ({record['address']})" if record.get("address") else ""
    return f"rank {record['rank']} on {record.get('host', '?')}{address}"


def describe(cause: dict[str, Any]) -> str:
    """One paragraph for the task's failure: the culprit first, then the collateral."""
    culprits = cause["culprits"]
    if cause["how"] == "raised":
        c = culprits[0]
        text = (f"{where(c)} raised {c.get('exception')} during step {c.get('step')}: {c.get('message')}\n    "
                + "\n    ".join(c.get("traceback") or []))
    else:
        steps = sorted({r.get("step") for r in cause["collateral"] if r.get("step") is not None})
        at = f" at step {steps[0]}" if len(steps) == 1 else ""
        text = (", ".join(where(c) for c in culprits) + f" stopped making progress{at}: "
                + ", ".join(f"rank {r['rank']}" for r in cause["collateral"])
                + " timed out or lost the connection waiting for it")
    torn = [r for r in cause["collateral"] if r.get("how") != "waited"]
    waiting = [r for r in cause["collateral"] if r.get("how") == "waited"]
    if cause["how"] == "raised" and (torn or waiting):
        text += "\n  collateral: " + "; ".join(
            [f"{where(r)} (its collective failed: {_short(r)})" for r in waiting]
            + [f"{where(r)} (torn down)" for r in torn])
    return text


def summary(cause: dict[str, Any]) -> dict[str, Any]:
    """What the try record and the ledger keep of ``cause``."""
    return {"how": cause["how"],
            "culprits": [{k: c.get(k) for k in ("rank", "host", "address", "step", "exception", "message", "origin")}
                         for c in cause["culprits"]],
            "collateral": [{"rank": r["rank"], "host": r.get("host"), "how": r.get("how") or "torn down"}
                           for r in cause["collateral"]]}


def _short(record: dict[str, Any]) -> str:
    message = (record.get("message") or "").strip().splitlines()
    return f"{record.get('exception')}: {message[0][:160] if message else ''}"
