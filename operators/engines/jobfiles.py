"""The files of a job folder, for the engines that keep one (``local``, ``slurm``): read without
tripping over a file that is missing or half written (they are written by
:func:`trainforge.storage.files.atomic_write_json`). Standard library only: the local engine's
supervisor process imports it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when the file is missing, not JSON or not an
    object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None
