"""The processes a node's torchrun leaves on a Ray node, and how the launcher stops them.

torchrun starts each rank in a session of its own, so a rank outlives an agent that is killed
(as Ray kills a job's workers once its driver returns). Every process of a node's job names the
node's job folder (``trainforge-<key>.node-<n>.``) on its command line (``--config``): after a
job that failed or was stopped, the launcher runs :func:`reap` on every node, which stops what
is left by that name; :func:`rank_records` brings back the ranks' records of its job folder. Only
the standard library and the job contract: the launcher's contract.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import tempfile
import time
from typing import Any

from trainforge.contract import RANK_RECORDS_DIR

STOP_GRACE_S = 20.0
"""SIGTERM to a node's torchrun (or a leftover rank), then SIGKILL after this many seconds."""


def pdeathsig() -> Any:
    """A function for ``preexec_fn`` that asks for SIGTERM when the parent dies
    (``prctl(PR_SET_PDEATHSIG)``), or None where there is no such call. libc is loaded here, in
    the parent: the child of a threaded process (a Ray worker) must not import or allocate."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM ``proc``, SIGKILL it after ``grace_s``; wait for it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def leftovers(marker: str) -> list[int]:
    """The pids of this machine's processes (not this one) whose command line holds
    ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def reap(marker: str, grace_s: float = STOP_GRACE_S) -> list[int]:
    """Ray task: SIGTERM every process named by ``marker`` (:func:`leftovers`), SIGKILL what is
    left after ``grace_s``; the pids it found."""
    found = leftovers(marker)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in leftovers(marker):
            try:
                os.kill(pid, sig)
            except OSError:
                continue
        deadline = time.monotonic() + wait_s
        while leftovers(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
    return found


def rank_records(folder_prefix: str) -> list[dict[str, Any]]:
    """Ray task: the rank records (trainforge.trainer.rank_record) of this node's job folder, the
    temporary folder whose name starts with ``folder_prefix``, as they are (unreadable ones left out)."""
    found = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{folder_prefix}*", RANK_RECORDS_DIR, "rank-*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            continue
    return found
