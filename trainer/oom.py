"""A CUDA out of memory in any rank, named: exit 80, result status ``out_of_memory``, with the
rank, the step, the phase (forward, backward, optimizer, checkpoint staging) and the memory asked
for and free (docs/trainer.md, "Out of memory").

`named_oom` wraps the training loop: a ``torch.OutOfMemoryError`` leaving it (or wrapped by another
exception on its way out) becomes `GpuOutOfMemoryError`. The phase is the call of the loop the
error came out of (`PHASES`), the step the loop's own. A rank other than 0 writes the result
file itself (rank 0 would only see its peers leave); `write_result` keeps that result when rank 0
then fails for that reason. The ``train`` task decides what a retry does (training.fault.on_oom).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from trainforge.contract import RESULT_FILE_ENV, STATUS_ERROR, STATUS_OOM
from trainforge.storage.files import atomic_write_json
from trainforge.trainer.errors import GpuOutOfMemoryError

PHASES = {"micro_batch_loss": "forward", "<genexpr>": "forward", "backward": "backward",
          "unscale": "optimizer", "clip_grad_norm": "optimizer", "step": "optimizer",
          "zero_grad": "optimizer", "save": "checkpoint staging"}
"""The loop's calls by name, and the phase an out of memory inside one of them is named with."""
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_ASKED = re.compile(r"Tried to allocate ([\d.]+) ([KMGT]?i?B)")
_FREE = re.compile(r"of which ([\d.]+) ([KMGT]?i?B) is free|([\d.]+) ([KMGT]?i?B) free")
_TOTAL = re.compile(r"total capacity of ([\d.]+) ([KMGT]?i?B)|([\d.]+) ([KMGT]?i?B) total capacity")
_last: list[dict[str, Any]] = []  # this process's record, for its result file


def _bytes(pattern: re.Pattern, text: str) -> int | None:
    m = pattern.search(text)
    if m is None:
        return None
    number, unit = (g for g in m.groups() if g is not None)
    return int(float(number) * _UNITS.get(unit, 1)) if unit in _UNITS else None


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.2f} GiB"


def oom_in(err: BaseException) -> torch.OutOfMemoryError | None:
    """The out of memory ``err`` is or carries (as its cause or context), else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, torch.OutOfMemoryError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def where(tb: TracebackType | None, loop: Callable) -> tuple[int, str]:
    """(step, phase) of an error whose traceback is ``tb``, from the frame of ``loop`` in it."""
    while tb is not None and tb.tb_frame.f_code is not loop.__code__:
        tb = tb.tb_next
    if tb is None:
        return 0, "startup"
    step = tb.tb_frame.f_locals.get("step")  # steps done; None before the resume
    callee = tb.tb_next.tb_frame.f_code.co_name if tb.tb_next is not None else ""
    phase = PHASES.get(callee, f"step ({callee})" if callee else "step")
    if step is None or phase == "checkpoint staging":  # after the step it saves
        return step or 0, phase
    return step + 1, phase


def describe(err: torch.OutOfMemoryError, *, rank: int, step: int, phase: str, device: torch.device,
             micro_batch_size: int, accum: int) -> GpuOutOfMemoryError:
    """The named error: the figures of the message where it has them, else the device's."""
    text = str(err)
    asked, free, total = _bytes(_ASKED, text), _bytes(_FREE, text), _bytes(_TOTAL, text)
    if (free is None or total is None) and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    record = {"rank": rank, "step": step, "phase": phase, "requested_bytes": asked, "free_bytes": free,
              "total_bytes": total, "micro_batch_size": micro_batch_size, "grad_accum_steps": accum}
    where_ = f"{device.type}:{device.index}" if device.index is not None else device.type
    message = (f"GPU out of memory on rank {rank} ({where_}) at step {step}, {phase}: tried to allocate "
               f"{_gib(asked)}, {_gib(free)} free of {_gib(total)}; micro-batch {micro_batch_size} x "
               f"accumulation {accum}")
    return GpuOutOfMemoryError(message, record)


@contextmanager
def named_oom(loop: Callable, cfg: Any, d: Any) -> Iterator[None]:
    """Run ``loop`` (the training loop) inside: an out of memory leaves as `GpuOutOfMemoryError`."""
    try:
        yield
    except BaseException as err:
        oom = oom_in(err)
        if oom is None:
            raise
        step, phase = where(err.__traceback__, loop)  # err left the loop: its traceback holds the loop's frame
        named = describe(oom, rank=d.rank, step=step, phase=phase, device=d.device,
                         micro_batch_size=cfg.optim.micro_batch_size, accum=cfg.grad_accum_steps(d.world_size))
        _last[:] = [named.record]
        result_file = os.environ.get(RESULT_FILE_ENV)
        if d.rank != 0 and result_file:  # rank 0 sees only its peers leave: this rank says why
            atomic_write_json(result_file, {"status": named.status, "exit_code": named.exit_code,
                                            "message": str(named), "oom": named.record})
        raise named from err


def write_result(path: str, result: dict[str, Any]) -> None:
    """Rank 0's result: with its out of memory's record, if that is how it failed; an error that
    followed another rank's out of memory keeps that rank's result (the cause) instead."""
    if result.get("status") == STATUS_OOM and _last:
        result = {**result, "oom": _last[-1]}
    elif result.get("status") == STATUS_ERROR and Path(path).is_file():
        try:
            earlier = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            earlier = None
        if isinstance(earlier, dict) and earlier.get("status") == STATUS_OOM:
            return
    atomic_write_json(path, result)
