"""Process-group lifecycle of the trainer: start it, pick the device, leave it without hanging.

Launched by torchrun, a worker sees RANK, LOCAL_RANK, WORLD_SIZE (and MASTER_ADDR/PORT) in its
environment; without them the trainer runs as a single process with no process group.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainforge.trainer.config import JobConfig
from trainforge.trainer.errors import ConfigError
from trainforge.trainer.verdict import recorded

log = logging.getLogger(__name__)


@dataclass
class Dist:
    enabled: bool  # launched by torchrun (RANK/WORLD_SIZE set) and a process group is up
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def setup_distributed(cfg: JobConfig) -> Dist:
    """Start the process group when run under torchrun; pick the device.

    Raises:
        ConfigError: ``distributed.backend`` is "nccl" but CUDA is not available.
    """
    cuda = torch.cuda.is_available()
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ConfigError("distributed.backend='nccl' needs CUDA, which this machine does not have; "
                          "use 'gloo' or 'auto'")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist(False, 0, 0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    started = time.perf_counter()
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.distributed.collective_timeout_s),
                            device_id=device if backend == "nccl" else None)
    log.info("process group up: backend=%s world_size=%d device=%s (%.1fs of startup)", backend, world, device,
             time.perf_counter() - started)
    return Dist(True, rank, local_rank, world, device)


def barrier_failure(err: BaseException) -> str:
    """What a failed final barrier says about who did not arrive, for the result file.

    Gloo's ``monitored_barrier`` names them ("[Rank 0]: Ranks 1, 3 failed to pass
    monitoredBarrier in 8000 ms"): then ``"collective timeout on rank 1, 3"``; any other error
    is ``"collective failure: <error>"``.
    """
    text = str(err)
    found = re.search(r"Ranks? (\d+(?:, \d+)*) failed to pass monitoredBarrier", text)
    if found:
        return f"collective timeout on rank {found.group(1)}"
    return f"collective failure: {type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _final_barrier(timeout_s: float) -> None:
    """Every rank meets here before leaving; gloo's monitored barrier names a rank that does not."""
    if dist.get_backend() == "gloo":
        # Its timeout must be given: without one it waits torch's default (30 min), not the group's.
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()


def shut_down(consistent: bool, code: int, timeout_s: float = 60.0) -> str | None:
    """Leave the process group without hanging and without outrunning rank 0's result file.

    torchrun stops every worker as soon as one exits non-zero, so after an error every rank
    first meets the others at a barrier (rank 0 has written the result file by then); when the
    error came before the process group was up, a gloo group is started just for that barrier.
    Errors that may be one rank's alone skip the barrier (peers may be stuck in a collective)
    and leave at once with os._exit: torchrun then stops the others.

    Args:
        consistent: every rank ended the same way (success, a config error, divergence), so all
            of them reach the barrier. The caller must hold no DDP model or optimizer anymore.
        code: the exit code, used by the os._exit path.
        timeout_s: how long the final barrier waits for every rank (the collective timeout).

    Returns:
        None when the group was left cleanly (or there was none); else what went wrong at the
        final barrier (:func:`barrier_failure`): after a finished training the caller reports
        it instead of a success that the job's exit status would contradict.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None  # not launched by torchrun: no peers
    if not consistent:
        code = recorded(code)  # exit 80: torchrun does not restart the group (trainer/verdict.py)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        gc.collect()  # known trap: a DDP model alive after destroy_process_group() can hang gloo at exit
        _final_barrier(timeout_s)
    except Exception as err:  # noqa: BLE001 - shutting down: reported by the caller
        log.warning("process group shutdown failed: %s", err)
        return barrier_failure(err)
    try:
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - every rank got past the barrier: nothing is lost
        log.warning("process group shutdown failed: %s", err)
    return None
