"""A rank the kernel's OOM killer ended, named in the job's failure, with what it was doing.

The evidence an engine has: torchrun's failure summary in the job log (each failed rank and its
exit code, minus a signal's number), an OOM-kill count (the local engine's cgroup
``oom_kill`` counter over the job; Slurm's state ``OUT_OF_MEMORY``), and the phase the rank last
wrote to the job folder (trainforge.contract.phase_file: ``staging checkpoint step 20
(pageable)``). docs/faults.md, "Host out of memory".
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from trainforge.contract import phase_file

__all__ = ["describe", "signalled_ranks"]

_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-\d+)")
TAIL_BYTES = 65_536


def signalled_ranks(log_text: str) -> dict[int, int]:
    """Rank -> the signal that ended it, from torchrun's failure summaries in ``log_text``."""
    return {int(rank): -int(code) for rank, code in _FAILED_RANK.findall(log_text)}


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - TAIL_BYTES))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _phase(job_dir: Path, rank: int) -> str | None:
    try:
        return Path(phase_file(str(job_dir), rank)).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def describe(job_dir: str | Path, logs: list[Path], oom_kills: int | None = None,
             oom_state: str | None = None) -> str | None:
    """What ended the job, when a rank was SIGKILLed or an OOM kill was counted; else None.

    Args:
        job_dir: the job folder, whose ``phase/`` files name what each rank was doing.
        logs: where torchrun's failure summaries are (each file's last 64 KiB is read).
        oom_kills: OOM kills counted in the job's cgroup while it ran (None: not counted).
        oom_state: the scheduler's name for an out of memory it saw (Slurm's ``OUT_OF_MEMORY``).
    """
    job_dir = Path(job_dir)
    ranks: dict[int, int] = {}
    for path in logs:
        ranks.update(signalled_ranks(_tail(path)))
    killed = sorted(r for r, sig in ranks.items() if sig == signal.SIGKILL)
    if not killed and not oom_kills and not oom_state:
        return None
    who = ", ".join(f"rank {r}" for r in killed) or "a rank"
    if oom_kills or oom_state:
        evidence = (f"the job's cgroup counted {oom_kills} OOM kill(s)" if oom_kills
                    else f"the scheduler says {oom_state}")
        head = f"{who} {'was' if len(killed) < 2 else 'were'} killed by the kernel's OOM killer ({evidence})"
        advice = ("the host ran out of memory: give the job more (training.resources.memory_gib) or "
                  "lower training.checkpoint.max_host_bytes")
    else:
        head = f"{who} {'was' if len(killed) < 2 else 'were'} killed by SIGKILL (signal 9)"
        advice = ("no cgroup counted an OOM kill: another process, or the kernel's OOM killer outside "
                  "the job's cgroup (see the machine's kernel log)")
    phases = [f"; rank {r}'s last phase: {p}" for r in (killed or [0]) if (p := _phase(job_dir, r))]
    return f"{head}{''.join(phases)}; {advice}"
