"""The server's home folder: the pid file that lets a later command find (and stop) a running
server, and the lock that keeps two starts from racing.

    mlflow-server.pid   JSON: pid, process create time, url, host, port, stores, log file
    mlflow-server.log   the server's stdout and stderr (appended on every start)
    mlflow-server.lock  held while a start runs
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

PID_FILE_NAME = "mlflow-server.pid"
LOG_FILE_NAME = "mlflow-server.log"
LOCK_FILE_NAME = "mlflow-server.lock"


def record_alive(record: Mapping[str, Any]) -> bool:
    """True when the pid file's process is alive and is the same process (not a reused pid)."""
    try:
        proc = psutil.Process(int(record["pid"]))
        same = abs(proc.create_time() - float(record["create_time"])) < 0.05
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def read_pid_file(home: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((home / PID_FILE_NAME).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        log.warning("ignoring unreadable pid file %s", home / PID_FILE_NAME)
        return {}
    return record if isinstance(record, dict) else {}


def write_pid_file(home: Path, record: Mapping[str, Any]) -> None:
    tmp = home / f".{PID_FILE_NAME}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, home / PID_FILE_NAME)


def remove_pid_file(home: Path, pid: object) -> None:
    """Remove the pid file if it still names ``pid`` (or is unreadable)."""
    record = read_pid_file(home)
    if record is not None and record.get("pid") in (pid, None):
        with contextlib.suppress(FileNotFoundError):
            (home / PID_FILE_NAME).unlink()


@contextlib.contextmanager
def home_lock(home: Path) -> Iterator[None]:
    with open(home / LOCK_FILE_NAME, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
