"""Each rank's own account of how it ended, so that a failed job names the rank that started it.

When it starts, every rank writes ``rank_records/rank-<R>-<host>-<pid>.json`` (trainforge.contract.
RANK_RECORDS_DIR) beside the result file, else in the job folder: its rank, host, the address it
reaches the rendezvous from, process and restart. When it ends with an error it adds how
(:data:`HOW`), the exit code, the step it was training and, when it raised, the exception and the
last lines of its traceback. A rank that hung or whose node went writes no end: the records are
read (trainforge.trainer.causes) to name the rank that started a failure, the others as
collateral. Stdlib only. docs/faults.md, "Who failed".
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Mapping
from typing import Any

from trainforge.contract import JOB_DIR_ENV, RANK_RECORDS_DIR, RESULT_FILE_ENV

HOW = ("raised", "waited", "terminated")
"""``raised``: an exception of its own; ``waited``: a collective failed under it (a peer left,
closed the connection or never came: it timed out waiting); ``terminated``: stopped by a signal
(torchrun tearing the group down, the task being killed)."""
TRACEBACK_LINES = 8
ALIVE_EVERY_S = 1.0
"""How often a training rank renews its record's modification time (:meth:`RankRecord.alive`)."""
# What a collective's failure says when a peer left or never came (gloo, NCCL, the c10d store).
_WAITED_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_WAITED_TEXT = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
                "gloo/transport", "nccl communicator was aborted", "watchdog caught collective",
                "socket timeout", "connection refused")


def job_folder(environ: Mapping[str, str]) -> str | None:
    """The local folder of the job's own files (rank records, restarts): the result file's,
    else the job folder; None when the engine gave neither, or an object store's."""
    result = environ.get(RESULT_FILE_ENV)
    folder = os.path.dirname(os.path.abspath(result)) if result else environ.get(JOB_DIR_ENV)
    return folder if folder and "://" not in folder else None


def records_dir(environ: Mapping[str, str]) -> str | None:
    """Where the job's rank records live: :func:`job_folder`/rank_records."""
    folder = job_folder(environ)
    return os.path.join(folder, RANK_RECORDS_DIR) if folder else None


def classify(err: BaseException) -> str:
    """:data:`HOW` of an exception: a signal, a failed collective, or the rank's own."""
    if type(err).__name__ == "TerminatedError" or isinstance(err, KeyboardInterrupt):
        return "terminated"
    text = f"{type(err).__name__}: {err}".lower()
    if any(type(e).__name__ in _WAITED_TYPES for e in _chain(err)) or any(t in text for t in _WAITED_TEXT):
        return "waited"
    return "raised"


def origin(err: BaseException) -> str | None:
    """Where ``err`` was raised: its innermost frame as ``folder/file.py:line in function`` (the
    file's last two path parts: the same on every host and install), None without a traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return None
    last = frames[-1]
    return f"{'/'.join(last.filename.replace(os.sep, '/').split('/')[-2:])}:{last.lineno} in {last.name}"


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def _address(environ: Mapping[str, str]) -> str | None:
    """The local address this host reaches the rendezvous (``MASTER_ADDR``) from; no packet sent."""
    target = environ.get("MASTER_ADDR")
    if not target:
        return None
    try:
        infos = socket.getaddrinfo(target, int(environ.get("MASTER_PORT") or 29500), type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except (OSError, ValueError, IndexError):
        return None


class RankRecord:
    """This rank's record; every write replaces the file whole and never fails the rank."""

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        folder = records_dir(environ)
        host = socket.gethostname()
        self.data: dict[str, Any] = {
            "rank": int(environ.get("RANK", "0") or 0), "local_rank": int(environ.get("LOCAL_RANK", "0") or 0),
            "world_size": int(environ.get("WORLD_SIZE", "1") or 1), "host": host,
            "address": _address(environ), "pid": os.getpid(),
            "restart": int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "run_id": environ.get("TORCHELASTIC_RUN_ID"), "started_at": round(time.time(), 3)}
        self.path = (os.path.join(folder, f"rank-{self.data['rank']}-{host}-{os.getpid()}.json")
                     if folder else None)
        self._touched = time.monotonic()
        self._write()

    def alive(self) -> None:
        """A sign of life, called every training step: the record's modification time, renewed at
        most every :data:`ALIVE_EVERY_S`, is the rank's last one when its node is lost
        (trainforge.engines.slurm.node_loss); ranks other than 0 print nothing while training."""
        now = time.monotonic()
        if self.path is None or now - self._touched < ALIVE_EVERY_S:
            return
        self._touched = now
        try:
            os.utime(self.path)
        except OSError:
            pass

    def ended(self, err: BaseException, exit_code: int, step: int) -> None:
        """The rank ends with ``err`` (exit ``exit_code``) while training step ``step``."""
        lines = "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip().splitlines()
        self.data.update(ended_at=round(time.time(), 3), how=classify(err), exit_code=exit_code, step=step,
                         exception=type(err).__name__, message=str(err)[:2000],
                         traceback=lines[-TRACEBACK_LINES:], origin=origin(err))
        self._write()

    def attempt(self, job_restart: int) -> None:
        """This rank belongs to attempt ``job_restart`` of the job (trainforge.trainer.restarts)."""
        self.data["job_restart"] = job_restart
        self._write()

    def discard(self) -> None:
        """Leave no record: an attempt past the restart budget, whose failure is the one before's."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None

    def _write(self) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as out:
                json.dump(self.data, out)
            os.replace(tmp, self.path)
        except OSError:
            self.path = None  # the failure message then names fewer ranks; training is not at stake
