"""Host memory for checkpoints: how rank 0 keeps the state while it is written, and each rank's phase.

`plan` decides once per process, from the bytes a save copies and the host memory it may use
(`budget`): pinned buffers when they fit, pageable ones when only those fit, else a synchronous
save (written from the live state while training waits: no copy). It logs the choice once and
the attempt record keeps it (``checkpoint_staging``). `note_phase` writes what a rank is doing
to the job folder (trainforge.contract.phase_file), for the engine to name an OOM kill with.
The rules and why: docs/trainer.md, "Host memory".
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from trainforge.contract import JOB_DIR_ENV, STAGING_MODES, cgroup_memory, phase_file
from trainforge.storage.files import atomic_write_bytes
from trainforge.trainer.checkpoint_writer import _shares

log = logging.getLogger(__name__)

__all__ = ["Plan", "budget", "choose", "decide", "note_phase", "plan", "staging_bytes", "unstaged"]


@dataclass(frozen=True)
class Plan:
    """One process's staging choice (`STAGING_MODES`) and what it was made from."""

    mode: str
    state_bytes: int  # what a pageable copy takes
    pinned_bytes: int  # what a pinned copy takes (each buffer rounded up to a power of two)
    budget_bytes: int | None  # None: unknown
    source: str  # where the budget came from

    def record(self) -> dict[str, Any]:
        """The attempt record's ``checkpoint_staging``."""
        return asdict(self)


def staging_bytes(tree: Any, copies: Any = None) -> tuple[int, int]:
    """``(pageable, pinned)`` bytes `HostStager.stage` would allocate for ``tree``'s tensors
    (``copies(tensor)``: whether it copies that one; default all). Pinned: CUDA tensors go to the
    caching host allocator, which rounds each buffer up to a power of two."""
    pageable = pinned = 0

    def walk(value: Any) -> None:
        nonlocal pageable, pinned
        if hasattr(value, "element_size") and hasattr(value, "numel"):
            if copies is None or copies(value):
                n = value.numel() * value.element_size()
                pageable += n
                pinned += (1 << (n - 1).bit_length()) if value.device.type == "cuda" and n else n
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(tree)
    return pageable, pinned


def budget(max_host_bytes: int | None) -> tuple[int | None, str]:
    """The host memory a save may add, and where that figure came from: ``checkpoint.max_host_bytes``
    when set; else the smaller of the cgroup's room (its limit less its working set) and the
    machine's MemAvailable; ``(None, why)`` when neither can be read."""
    if max_host_bytes is not None:
        return max_host_bytes, "checkpoint.max_host_bytes"
    machine = _mem_available()
    cg = cgroup_memory()
    if cg is not None and cg["limit"] is not None:
        room = max(0, cg["limit"] - cg["usage"])
        if machine is None or room <= machine:
            name = "memory.max" if cg["version"] == 2 else "memory.limit_in_bytes"
            return room, (f"cgroup v{cg['version']} {name} {_gib(cg['limit'])} of {cg['dir']}, less "
                          f"{_gib(cg['usage'])} in use")
    if machine is not None:
        return machine, "the machine's MemAvailable (/proc/meminfo)"
    return None, "unknown: no cgroup limit or /proc/meminfo could be read"


def choose(state_bytes: int, pinned_bytes: int, budget_bytes: int | None, cuda: bool) -> str:
    """Pinned (CUDA state only) when ``pinned_bytes`` fit the budget, pageable when
    ``state_bytes`` do, else synchronous. An unknown budget keeps the background save."""
    if budget_bytes is None:
        return "pinned" if cuda else "pageable"
    if cuda and pinned_bytes <= budget_bytes:
        return "pinned"
    return "pageable" if state_bytes <= budget_bytes else "synchronous"


def plan(tree: Any, max_host_bytes: int | None, copies: Any = None) -> Plan:
    """`choose` for ``tree`` under `budget`, logged (one line)."""
    pageable, pinned = staging_bytes(tree, copies)
    cuda = _any_cuda(tree)
    limit, source = budget(max_host_bytes)
    mode = choose(pageable, pinned, limit, cuda)
    assert mode in STAGING_MODES
    what = {"pinned": "pinned host buffers, written in the background",
            "pageable": "pageable host buffers, written in the background" + ("" if cuda else " (CPU state)"),
            "synchronous": "no copy: each checkpoint is written while training waits"}[mode]
    log.info("checkpoint staging: %s; the state takes %s%s, the budget is %s (%s)", what, _gib(pageable),
             f" ({_gib(pinned)} in pinned buffers)" if cuda else "", "unknown" if limit is None else _gib(limit), source)
    return Plan(mode, pageable, pinned, limit, source)


def unstaged(tree: Any) -> Any:
    """``tree`` as a synchronous save writes it: the live tensors themselves (a non-contiguous one
    packed, as safetensors needs), for a write the caller waits for."""
    if hasattr(tree, "is_contiguous"):
        return tree.detach() if tree.is_contiguous() else tree.detach().contiguous()
    if isinstance(tree, dict):
        return {k: unstaged(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [unstaged(v) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def decide(writer: Any, max_host_bytes: int | None, tree: Any, shared: set[int] | None, clock: Any,
           step: int | None) -> str:
    """``writer``'s staging mode: `plan` at its first call (a save's, or the reservation's before
    the first step), then kept; the stager set to it, ``clock`` (the attempt record) told, and a
    save's phase noted for an OOM kill's message (``step``: the checkpoint's; None: no save)."""
    if writer.plan is None:
        copies = None if shared is None else (lambda t: t.device.type != "cpu" or _shares(t, shared))
        writer.plan = plan(tree, max_host_bytes, copies)
        writer.stager.pin = writer.plan.mode == "pinned"
    if clock is not None:
        clock.staging = writer.plan.record()
    if step is not None:
        note_phase(0, f"staging checkpoint step {step} ({writer.plan.mode})")
    return writer.plan.mode


def note_phase(rank: int, phase: str) -> None:
    """Write ``phase`` as rank ``rank``'s current one under ``$TRAINFORGE_JOB_DIR`` (where there is
    one); a file that cannot be written is skipped: it only names an OOM kill."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir:
        return
    try:
        path = phase_file(job_dir, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_bytes(path, phase.encode("utf-8"))
    except OSError:
        pass


def _any_cuda(tree: Any) -> bool:
    if hasattr(tree, "device"):
        return tree.device.type == "cuda"
    if isinstance(tree, dict):
        return any(_any_cuda(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_any_cuda(v) for v in tree)
    return False


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
