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

The same holds for an ``s3://`` root (:mod:`trainforge.storage`): S3 has no rename, so every
object is copied and the originals are deleted manifest first.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainforge.storage import Location, StorageError, storage_for
from trainforge.trainer.checkpoint import MANIFEST, QUARANTINE_REASON
from trainforge.trainer.errors import CheckpointError

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
QUARANTINE_FORMAT = "trainforge.quarantine/v1"


def quarantine(step_dir: str | Path, reasons: Sequence[str], failed_checks: Sequence[str] = (),
               step: int | None = None, by: str = "trainforge.trainer.validate") -> Location:
    """Move ``step_dir`` to ``<its parent>/quarantine/<name>[.N]/`` with a QUARANTINE_REASON.json.

    Args:
        reasons: one human-readable line per problem (the failed checks' details).
        failed_checks: names of the failed validation checks (``file_hashes``, ``finite``, ...).
        step: the checkpoint's step when known (from its manifest).
    Returns:
        The folder's new location (a ``Path`` on disk, a URI on S3).
    Raises:
        CheckpointError: ``step_dir`` does not exist, or the write or move failed.
    """
    store = storage_for(step_dir)
    step_dir = store.join(step_dir)
    if not store.is_dir(step_dir):
        raise CheckpointError(f"quarantine {step_dir}: not a directory (already moved?)")
    reason = {"format": QUARANTINE_FORMAT, "checkpoint": store.absolute(step_dir),
              "step": step, "quarantined_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "reasons": list(reasons), "failed_checks": list(failed_checks), "by": by}
    target_root = store.join(store.parent(step_dir), QUARANTINE_DIR)
    name = store.name(step_dir)
    try:
        # From here on the folder never verifies.
        store.write_bytes(store.join(step_dir, QUARANTINE_REASON), (json.dumps(reason, indent=2) + "\n").encode())
        taken = set(store.list_dirs(target_root))
        target_name, n = name, 0
        while target_name in taken:
            n += 1
            target_name = f"{name}.{n}"
        target = store.join(target_root, target_name)
        store.move_dir(step_dir, target, first=MANIFEST)
    except StorageError as err:
        raise CheckpointError(f"quarantine {step_dir} into {target_root} failed: {err}") from err
    log.warning("quarantined %s -> %s: %s", step_dir, target, "; ".join(reasons))
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
