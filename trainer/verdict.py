"""A permanent verdict (exit 78, 79 or 80) ends the job: torchrun's restarts do not train again.

torchrun restarts its worker group after any failure while ``fault.max_restarts`` allows,
whatever the exit code. A rank that exits with a code of
:data:`~trainforge.contract.PERMANENT_EXIT_CODES` under a torchrun that may restart it writes
:data:`VERDICT_FILE` into the job folder (beside the result file); a restarted rank
(``TORCHELASTIC_RESTART_COUNT`` > 0) of the same torchrun run (``TORCHELASTIC_RUN_ID``) that finds
one exits at once with its code, before torch or the model is imported, and leaves the result
file of the attempt that reached the verdict: the task's failure names it. torchrun may still
start a restart before the verdict reaches it; each ends within a second. To keep torchrun from
restarting at all, the first rank of a node to reach a verdict stops that node's torchrun agent
(its parent) with SIGTERM when the agent has restarts left (:func:`stop_agent`); the Slurm engine's
srun then ends the other nodes. Stdlib only (it runs before torch).
docs/faults.md, "Permanent verdicts stop at once".
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Mapping

from trainforge.contract import (EXIT_CONFIG, EXIT_DIVERGED, EXIT_OOM, JOB_DIR_ENV, PERMANENT_EXIT_CODES,
                                 RESULT_FILE_ENV, STATUS_BAD_CONFIG, STATUS_DIVERGED, STATUS_OOM)

VERDICT_FILE = "verdict.json"
STATUSES = {EXIT_CONFIG: STATUS_BAD_CONFIG, EXIT_DIVERGED: STATUS_DIVERGED, EXIT_OOM: STATUS_OOM}
"""The result status of each permanent exit code (trainforge.contract)."""


def verdict_path(environ: Mapping[str, str]) -> str | None:
    """Where this job's verdict lives: beside the result file, else in the job folder; None
    when the engine gave neither."""
    result = environ.get(RESULT_FILE_ENV)
    folder = os.path.dirname(os.path.abspath(result)) if result else environ.get(JOB_DIR_ENV)
    return os.path.join(folder, VERDICT_FILE) if folder else None


def _restart(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ.get(name) or 0)
    except ValueError:
        return 0


def recorded(code: int, environ: Mapping[str, str] = os.environ) -> int:
    """``code``, after writing this rank's verdict when ``code`` is permanent and torchrun may
    restart the group (``TORCHELASTIC_MAX_RESTARTS`` > 0). A verdict that cannot be written
    costs only the restarts it would have saved."""
    path = verdict_path(environ)
    if code not in PERMANENT_EXIT_CODES or not path or _restart(environ, "TORCHELASTIC_MAX_RESTARTS") < 1:
        return code
    record = {"run_id": environ.get("TORCHELASTIC_RUN_ID"), "restart": _restart(environ, "TORCHELASTIC_RESTART_COUNT"),
              "exit_code": code, "status": STATUSES[code], "rank": _restart(environ, "RANK"),
              "host": socket.gethostname()}
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"  # ranks of several nodes may write at once
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(record, out)
        os.replace(tmp, path)
    except OSError as err:
        print(f"trainforge: could not record the verdict in {path} ({err}); torchrun may restart the group",
              file=sys.stderr, flush=True)
    if _restart(environ, "TORCHELASTIC_RESTART_COUNT") < _restart(environ, "TORCHELASTIC_MAX_RESTARTS"):
        stop_agent(record, path)
    return code


def stop_agent(record: dict, path: str) -> None:
    """Stop this node's torchrun agent (this process's parent) with SIGTERM, so that it does not
    restart the group for a verdict a restart cannot change: torchrun's log then shows one attempt.
    One rank per agent sends it (the first to create ``path``'s marker for the agent); nothing when
    the parent is not torchrun. The verdict file still stops a restart that starts meanwhile."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return
    if b"torch.distributed.run" not in argv and not any(a.endswith(b"/torchrun") or a == b"torchrun" for a in argv):
        return
    try:  # the other ranks of this agent: it is being stopped already
        os.close(os.open(f"{path}.stop-{socket.gethostname()}-{parent}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return
    print(f"trainforge: rank {record['rank']}: {record['status']} (exit {record['exit_code']}) is permanent: stopping "
          f"this node's torchrun agent (pid {parent}) so that it does not restart the group", flush=True)
    try:
        os.kill(parent, signal.SIGTERM)
    except OSError:
        pass


def decided(environ: Mapping[str, str] = os.environ) -> dict | None:
    """The permanent verdict an earlier attempt of this torchrun run reached, when this rank is a
    restart of it; else None."""
    restart = _restart(environ, "TORCHELASTIC_RESTART_COUNT")
    path = verdict_path(environ)
    if restart < 1 or not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if (not isinstance(record, dict) or record.get("run_id") != environ.get("TORCHELASTIC_RUN_ID")
            or record.get("exit_code") not in PERMANENT_EXIT_CODES or not isinstance(record.get("restart"), int)
            or record["restart"] >= restart):
        return None
    return record


def end_if_decided(name: str, environ: Mapping[str, str] = os.environ) -> None:
    """In the trainer program (``name`` is ``"__main__"``): exit with the code of :func:`decided`'s
    verdict, saying so on stdout, without training; otherwise return."""
    record = decided(environ) if name == "__main__" else None
    if record is None:
        return
    print(f"trainforge: rank {environ.get('RANK', '0')}, restart {environ.get('TORCHELASTIC_RESTART_COUNT')}: "
          f"attempt {record['restart']} ended with a permanent verdict ({record['status']}, exit "
          f"{record['exit_code']}, rank {record.get('rank')} on {record.get('host')}); exiting without "
          f"training, since a restart cannot change it", flush=True)
    sys.exit(record["exit_code"])
