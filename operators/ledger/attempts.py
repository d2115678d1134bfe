"""The trainer's attempt records (MLflow tags ``trainforge.ledger.attempt.<ms>``), summed.

Each attempt is one start of the trainer; its rank 0 wrote its buckets at every log interval
and when training ended (trainforge.trainer.goodput). Between two attempts lies a disruption:
from the failed attempt's last record to the next attempt's process start is ``recovery`` time
(noticing the failure, stopping the group, scheduling and starting it again); the next
attempt's start-up and checkpoint load stay in their own buckets, and its steps up to the
furthest step reached before are ``wasted_progress``. A disruption's recovery *time* (the
``recovery/mean_s`` and ``recovery/max_s`` figures) runs from the failed attempt's last record
to the restarted attempt's first step, as Google's goodput library and torchtitan count it.

The last record of an attempt is at most a few seconds old when the attempt dies (the trainer
flushes it every ``FLUSH_EVERY_S``, after a step, and at every checkpoint); the rest, up to the
kill, lies in the next gap, counted by the orchestrator (trainforge.ledger.tries).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge.contract import LEDGER_DIR, LEDGER_TAG_PREFIX as RECORD_TAG_PREFIX
from trainforge.storage import Location, Storage, storage_for

_SECONDS = {"startup": "program_startup", "restore": "checkpoint_restore",
            "data_wait": "data_loading", "save": "checkpoint_save", "eval": "evaluation",
            "compile": "compile", "wasted": "wasted_progress"}


class AttemptRecordError(ValueError):
    """An attempt record tag that is not the trainer's JSON."""


def job_dir_records(job_dir: str | Path) -> dict[str, str]:
    """The attempt records a job folder holds (``ledger/attempt-<ms>.json``), keyed as their
    MLflow tags are, for :func:`attempt_records` (a job run without MLflow, e.g. a benchmark)."""
    return folder_records(Path(job_dir) / LEDGER_DIR)


def folder_records(folder: Location, storage: Storage | None = None) -> dict[str, str]:
    """The attempt records in ``folder`` (``attempt-<ms>.json``: a job folder's ``ledger/``, or
    the task's ledger folder every try writes to, ``$TRAINFORGE_LEDGER_DIR``), keyed as their
    MLflow tags are; empty when the folder does not exist.

    Raises:
        StorageError: the folder or a record cannot be read (names the location).
    """
    storage = storage or storage_for(folder)
    found = {}
    for name in storage.list_files(folder):
        if name.startswith("attempt-") and name.endswith(".json"):
            data = storage.read_bytes(storage.join(folder, name))
            if data is not None:
                found[f"{RECORD_TAG_PREFIX}{name[len('attempt-'):-len('.json')]}"] = data.decode()
    return found


def merge_records(*sources: dict[str, str]) -> dict[str, str]:
    """Attempt records from several places (MLflow tags, record files), one per attempt: of two
    copies of one attempt's record, the later one (``recorded_at``); other keys pass as they are."""
    merged: dict[str, str] = {}
    for source in sources:
        for key, value in source.items():
            if key in merged and key.startswith(RECORD_TAG_PREFIX):
                if _recorded_at(value) < _recorded_at(merged[key]):
                    continue
            merged[key] = value
    return merged


def _recorded_at(text: str) -> float:
    try:
        return float(json.loads(text)["recorded_at"])
    except (ValueError, KeyError, TypeError):
        return float("-inf")


def attempt_records(tags: dict[str, str]) -> list[dict[str, Any]]:
    """The run's attempt records, oldest first.

    Raises:
        AttemptRecordError: a record tag does not hold a JSON object with ``started_at`` and
            ``seconds`` (names the tag and what it holds).
    """
    records = []
    for key, value in tags.items():
        if not key.startswith(RECORD_TAG_PREFIX):
            continue
        try:
            record = json.loads(value)
        except json.JSONDecodeError as err:
            raise AttemptRecordError(f"tag {key}: not JSON ({err}): {value[:200]!r}") from err
        if not isinstance(record, dict) or "started_at" not in record or "seconds" not in record:
            raise AttemptRecordError(f"tag {key}: expected the trainer's attempt record (an object "
                                     f"with started_at and seconds), got {value[:200]!r}")
        records.append(record)
    return sorted(records, key=lambda r: float(r["started_at"]))


@dataclass
class TrainerBooks:
    """The attempts' sums: trainer buckets (seconds), productive time and work, disruptions."""

    buckets: dict[str, float]
    productive_s: float
    productive_tokens: int
    recoveries_s: list[float]
    first_start: float | None
    last_record: float | None
    world_size: int | None
    device: str | None
    flops_per_token: float | None
    background_save_s: float | None = None  # checkpoint writes beside the steps (no bucket); None: not recorded
    compiled: str | None = None  # how the steps ran (contract.COMPILE_MODES); None: not recorded
    staging: str | None = None  # checkpoint staging (contract.STAGING_MODES), attempts' choices; None: none


def sum_attempts(records: list[dict[str, Any]]) -> TrainerBooks:
    """The trainer's part of the ledger from its attempt records (oldest first)."""
    buckets = {name: 0.0 for name in (*_SECONDS.values(), "recovery")}
    productive_s, tokens, recoveries = 0.0, 0, []
    background = [float(r["background_save_s"]) for r in records if "background_save_s" in r]
    for i, rec in enumerate(records):
        seconds = rec["seconds"]
        for short, bucket in _SECONDS.items():
            buckets[bucket] += float(seconds.get(short, 0.0))
        productive_s += float(seconds.get("productive", 0.0))
        tokens += int(rec.get("productive_steps", 0)) * int(rec.get("tokens_per_step", 0))
        if i:
            failed_at = float(records[i - 1]["recorded_at"])
            buckets["recovery"] += max(0.0, float(rec["started_at"]) - failed_at)
            if rec.get("first_step_at") is not None:
                recoveries.append(max(0.0, float(rec["first_step_at"]) - failed_at))
    last = records[-1] if records else {}
    return TrainerBooks(
        buckets=buckets, productive_s=productive_s, productive_tokens=tokens,
        recoveries_s=recoveries,
        first_start=float(records[0]["started_at"]) if records else None,
        last_record=float(last["recorded_at"]) if records else None,
        world_size=last.get("world_size"), device=last.get("device"),
        flops_per_token=last.get("flops_per_token"), background_save_s=sum(background) if background else None,
        compiled=_compiled(records), staging=_staging(records))


def _compiled(records: list[dict[str, Any]]) -> str | None:
    """How the attempts' steps ran: their one ``compiled``, ``partly_eager`` when they differ, or
    None when an attempt (a trainer from before) did not say."""
    modes = {rec.get("compiled") for rec in records if rec.get("productive_steps") or rec.get("wasted_steps")}
    if not modes or None in modes:
        return None
    return modes.pop() if len(modes) == 1 else "partly_eager"


def _staging(records: list[dict[str, Any]]) -> str | None:
    """The attempts' checkpoint staging modes, each once in order (None: no attempt saved)."""
    modes = [rec["checkpoint_staging"]["mode"] for rec in records if isinstance(rec.get("checkpoint_staging"), dict)]
    return ",".join(dict.fromkeys(modes)) or None
