"""Holding a local job still: its rank processes stopped (SIGSTOP) and continued, so a fault test
knows the job is alive and unfinished at a given moment, however fast the machine trains."""

from __future__ import annotations

import contextlib
from pathlib import Path

import psutil

from faultlib import job_processes


def rank_processes(path: Path) -> list[psutil.Process]:
    """The job's rank processes: torchrun's workers running the trainer module (not torchrun
    itself, not the engine's supervisor)."""
    return [p for p in job_processes(path)
            if any("trainforge.trainer.train" in part for part in p.cmdline())
            and not any("torch.distributed.run" in part or part.endswith("torchrun")
                        for part in p.cmdline())]


@contextlib.contextmanager
def ranks_held(path: Path):
    """SIGSTOP the job's ranks for the ``with`` block, SIGCONT them after: the job stays alive
    (and unfinished) at a known step however fast this machine trains."""
    ranks = rank_processes(path)
    assert ranks, f"no rank process of the job in {path}"
    for proc in ranks:
        proc.suspend()
    try:
        yield ranks
    finally:
        for proc in ranks:
            try:
                proc.resume()
            except psutil.NoSuchProcess:
                pass
