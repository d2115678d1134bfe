"""One restart budget per job: ``fault.max_restarts`` counts the job's in-job restarts, whichever
node's torchrun agent restarted its workers.

Each node's agent keeps its own count (``TORCHELASTIC_RESTART_COUNT``) and spends it only on a
failure of its own workers; a node that joins the new round for another node's failure counts
nothing. So with ``max_restarts: 1`` and one rank exiting on each host in turn, the job got two
restarts, and the nodes disagreed on which restart it was. Instead, each attempt's rank 0 counts
the job's attempts in :data:`~trainforge.contract.RESTARTS_FILE` beside the result file (the job
folder, which the nodes share on the local and Slurm engines), with the cause of the restart
(the rank records of the attempt before, trainforge.trainer.causes), and every rank learns the
attempt's index from rank 0 by broadcast: the same on every node. An attempt past the budget ends
at once with the exit code of the attempt that spent it, leaving that attempt's result file and
rank records to name the failure. docs/faults.md, "One restart budget".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainforge.contract import EXIT_ERROR, RESTARTS_FILE, RESULT_FILE_ENV
from trainforge.storage.files import atomic_write_json
from trainforge.trainer.causes import describe, root_cause, summary
from trainforge.trainer.rank_record import job_folder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobAttempt:
    """This attempt of the job: ``index`` 0 for the first, n for the n-th in-job restart."""

    index: int
    max_restarts: int
    exit_code: int  # of the attempt before, which an attempt past the budget ends with

    @property
    def over_budget(self) -> bool:
        return self.index > self.max_restarts


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ.get(name) or 0)
    except ValueError:
        return 0


def count_attempt(environ: Mapping[str, str] = os.environ) -> tuple[int, int, str | None]:
    """Rank 0: ``(index, exit code of the attempt before, cause of the restart)`` of this attempt,
    recorded in the job folder's restarts file with the cause when it is a restart within the
    budget (``TORCHELASTIC_MAX_RESTARTS``). Outside torchrun, or without a job folder: (0, 1, None)."""
    folder, run_id = job_folder(environ), environ.get("TORCHELASTIC_RUN_ID")
    if folder is None or run_id is None:
        return 0, EXIT_ERROR, None
    path = os.path.join(folder, RESTARTS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    attempts = data.get("attempts") if isinstance(data, dict) and data.get("run_id") == run_id else None
    attempts = attempts if isinstance(attempts, list) else []
    index = len(attempts)
    entry: dict[str, Any] = {"index": index, "started_at": round(time.time(), 3), "host": socket.gethostname(),
                             "agent_restart": _int(environ, "TORCHELASTIC_RESTART_COUNT")}
    previous = _previous_exit_code(environ)
    if index >= 1:
        cause = root_cause(folder, index - 1)
        ended = [r.get("ended_at") for r in ((cause or {}).get("culprits") or []) + ((cause or {}).get("collateral") or [])
                 if isinstance(r.get("ended_at"), (int, float))]
        entry.update(after=summary(cause) if cause else None, failed_at=min(ended) if ended else None,
                     cause=describe(cause).splitlines()[0] if cause else f"exit {previous}, cause unknown")
    if index <= _int(environ, "TORCHELASTIC_MAX_RESTARTS"):
        try:
            atomic_write_json(path, {"run_id": run_id, "attempts": [*attempts, entry]})
        except OSError as err:
            log.warning("could not record the job's attempt in %s (%s): its restarts count per node", path, err)
    return index, previous, entry.get("cause")


def _previous_exit_code(environ: Mapping[str, str]) -> int:
    """The exit code in the result file the attempt before left (1 when there is none)."""
    result = environ.get(RESULT_FILE_ENV)
    try:
        with open(result or "", encoding="utf-8") as f:
            code = json.load(f).get("exit_code")
    except (OSError, ValueError, AttributeError):
        return EXIT_ERROR
    return code if isinstance(code, int) and code != 0 else EXIT_ERROR


def begin_attempt(enabled: bool, rank: int, device: Any, record: Any = None,
                  environ: Mapping[str, str] = os.environ) -> JobAttempt:
    """This attempt of the job, the same on every rank: rank 0 counts it (:func:`count_attempt`),
    the process group carries it to the others, and every rank says it on stdout when it is a
    restart. Within the budget, ``record`` (this rank's RankRecord) is marked with the attempt and
    rank 0 removes the result file of the attempt before (a stale result must not speak for this
    one); past it, ``record`` is discarded and the result file kept."""
    max_restarts = _int(environ, "TORCHELASTIC_MAX_RESTARTS")
    index, code, cause = count_attempt(environ) if rank == 0 else (0, EXIT_ERROR, None)
    counted = [index, code]
    if enabled:
        import torch.distributed as dist

        dist.broadcast_object_list(counted, src=0, device=device)
    attempt = JobAttempt(int(counted[0]), max_restarts, int(counted[1]))
    if attempt.index:
        said = ("past fault.max_restarts: this attempt ends at once with the exit code of the one before "
                f"({attempt.exit_code})" if attempt.over_budget else "within fault.max_restarts")
        print(f"trainforge: rank {rank} on {socket.gethostname()}: job restart {attempt.index} of "
              f"{max_restarts} ({said}; this node's torchrun agent counts "
              f"{_int(environ, 'TORCHELASTIC_RESTART_COUNT')})" + (f", after: {cause}" if cause else ""), flush=True)
    if record is not None and attempt.over_budget:
        record.discard()
    elif record is not None:
        record.attempt(attempt.index)
    result = environ.get(RESULT_FILE_ENV)
    if rank == 0 and result and not attempt.over_budget:
        try:
            os.unlink(result)
        except FileNotFoundError:
            pass
    return attempt
