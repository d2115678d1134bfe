"""Move an invalid checkpoint aside, with the reason, instead of deleting it.

    <checkpoints>/step-00000300/            invalid (torn write, NaN weights, bad hashes, ...)
    -> <checkpoints>/quarantine/step-00000300/
         QUARANTINE_REASON.json              {"format", "checkpoint", "step", "quarantined_at",
                                              "reasons": [...], "failed_checks": [...], "by"}

Order of operations: the reason file is written INTO the step folder first (atomically), which
alone makes `trainforge.trainer.checkpoint.verify` refuse the folder, then the folder is renamed into
``quarantine/``. A crash between the two leaves a folder that resume and the validator already
skip; nothing is ever deleted. ``quarantine/`` does not match ``step-*``, so resume
(`checkpoint.newest_valid`) and retention (`checkpoint.apply_retention`) never see it.

A second quarantine of the same step (a retry re-wrote it and it broke again) goes to
``quarantine/step-00000300.1/``, ``.2``, ...
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainforge.trainer.checkpoint import QUARANTINE_REASON
from trainforge.trainer.errors import CheckpointError
from trainforge.trainer.fsutil import atomic_write_json, fsync_dir

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
QUARANTINE_FORMAT = "trainforge.quarantine/v1"


def quarantine(step_dir: str | Path, reasons: Sequence[str], failed_checks: Sequence[str] = (),
               step: int | None = None, by: str = "trainforge.trainer.validate") -> Path:
    """Move ``step_dir`` to ``<its parent>/quarantine/<name>[.N]/`` with a QUARANTINE_REASON.json.

    Args:
        reasons: one human-readable line per problem (the failed checks' details).
        failed_checks: names of the failed validation checks (``file_hashes``, ``finite``, ...).
        step: the checkpoint's step when known (from its manifest).
    Returns:
        The folder's new path.
    Raises:
        CheckpointError: ``step_dir`` does not exist, or the write or rename failed.
    """
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise CheckpointError(f"quarantine {step_dir}: not a directory (already moved?)")
    target_root = step_dir.parent / QUARANTINE_DIR
    reason = {"format": QUARANTINE_FORMAT, "checkpoint": str(step_dir.resolve()), "step": step,
              "quarantined_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "reasons": list(reasons), "failed_checks": list(failed_checks), "by": by}
    try:
        atomic_write_json(step_dir / QUARANTINE_REASON, reason)  # from here on it never verifies
        target_root.mkdir(exist_ok=True)
        target = _free_name(target_root, step_dir.name)
        os.rename(step_dir, target)
        fsync_dir(step_dir.parent)
        fsync_dir(target_root)
    except OSError as err:
        raise CheckpointError(f"quarantine {step_dir} into {target_root} failed: {err}") from err
    log.warning("quarantined %s -> %s: %s", step_dir, target, "; ".join(reasons))
    return target


def _free_name(root: Path, name: str) -> Path:
    target, n = root / name, 0
    while target.exists():
        n += 1
        target = root / f"{name}.{n}"
    return target


def list_quarantined(checkpoints_dir: str | Path) -> list[dict[str, Any]]:
    """The QUARANTINE_REASON.json of every folder under ``<checkpoints_dir>/quarantine/``, by name,
    each with ``path`` added (an unreadable reason file gives ``{"path", "error"}``)."""
    root = Path(checkpoints_dir) / QUARANTINE_DIR
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            out.append({**json.loads((folder / QUARANTINE_REASON).read_text(encoding="utf-8")),
                        "path": str(folder)})
        except (OSError, ValueError) as err:
            out.append({"path": str(folder), "error": f"{QUARANTINE_REASON}: {err}"})
    return out


def is_quarantined(step_dir: str | Path) -> bool:
    """True when ``step_dir`` carries a QUARANTINE_REASON.json or lives under ``quarantine/``."""
    step_dir = Path(step_dir)
    return (step_dir / QUARANTINE_REASON).exists() or step_dir.parent.name == QUARANTINE_DIR
