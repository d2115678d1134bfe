"""The files of a job folder, for the engines that keep one (``local``, ``slurm``): written
atomically, read without tripping over a file that is missing or half written. Standard
library only: the local engine's supervisor process imports it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, obj: object) -> None:
    """Write JSON to ``path`` through a temporary file and ``os.replace`` (atomic on POSIX)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when the file is missing, not JSON or not an
    object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None
