"""Checkpoints written in the background: the state copied to host memory, then written on a thread.

Training blocks only while `CheckpointWriter.stage` copies the state; the files, their hashes, the
manifest (last) and retention are written on the writer's thread. The writer never runs a
collective (its peers are training on), writes one checkpoint at a time, and never publishes a
manifest once `CheckpointWriter.abandon` returned. Why a thread: docs/contracts.md, "Checkpoint
writes" (under "Trainer details"); what happens on SIGTERM: docs/faults.md; the whole story:
docs/trainer.md.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainforge.storage import Location
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.errors import CheckpointError

log = logging.getLogger(__name__)

__all__ = ["CheckpointWriter", "HostStager", "WriteResult"]


class HostStager:
    """Host copies of checkpoint state that training may go on changing while they are written.

    CUDA tensors are copied into pinned host buffers, allocated on first use and reused by every
    later save (keyed by their place in the state, shape and dtype), with ``non_blocking`` copies
    and one synchronize at the end. CPU tensors are cloned (never pinned: pinning needs CUDA),
    except, when ``shared`` is given, those whose storage is not in it: those are private copies
    already (FSDP's full state gathered to the CPU) and are taken as they are. Dicts, lists and
    tuples are rebuilt; other values are kept.
    """

    def __init__(self) -> None:
        self._pinned: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self.pin = True  # False: pageable buffers instead (trainforge.trainer.host_memory)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory held for reuse."""
        return sum(t.numel() * t.element_size() for t in self._pinned.values())

    def stage(self, tree: Any, shared: set[int] | None = None) -> Any:
        """``tree`` with every tensor a host copy (see the class docstring).

        Args:
            shared: storage addresses (`storage_addresses`) of the tensors training changes in
                place; None: copy every tensor.
        """
        used: set[tuple[str, tuple[int, ...], torch.dtype]] = set()
        on_cuda = False

        def copy(path: str, value: Any) -> Any:
            nonlocal on_cuda
            if isinstance(value, torch.Tensor):
                if value.device.type == "cuda":
                    on_cuda = True
                    return self._pinned_copy(path, value.detach(), used)
                if value.device.type != "cpu":
                    return value.detach().to("cpu", copy=True).contiguous()
                if shared is not None and not _shares(value, shared):
                    return value
                return value.detach().clone(memory_format=torch.contiguous_format)
            if isinstance(value, dict):
                return {k: copy(f"{path}/{k}", v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                items = [copy(f"{path}/{i}", v) for i, v in enumerate(value)]
                return items if isinstance(value, list) else tuple(items)
            return value

        staged = copy("", tree)
        if on_cuda:
            torch.cuda.synchronize()  # every non_blocking copy has landed
        for key in set(self._pinned) - used:  # the state changed shape: free what no longer fits
            del self._pinned[key]
        return staged

    def reserve(self, tree: Any) -> int:
        """Allocate (without copying) the pinned buffers `stage` will need for ``tree``'s CUDA
        tensors; returns the bytes allocated. Pinning host memory runs at a few GB/s, so the first
        save of a large model would block for seconds: the trainer calls this on a thread early
        instead (`CheckpointWriter.reserve_in_background`)."""
        allocated = 0

        def walk(path: str, value: Any) -> None:
            nonlocal allocated
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                key = (path, tuple(value.shape), value.dtype)
                if key not in self._pinned:
                    self._pinned[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                    allocated += value.numel() * value.element_size()
            elif isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{path}/{k}", v)
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    walk(f"{path}/{i}", v)

        walk("", tree)
        return allocated

    def _pinned_copy(self, path: str, value: torch.Tensor, used: set) -> torch.Tensor:
        key = (path, tuple(value.shape), value.dtype)
        buffer = self._pinned.get(key)
        if buffer is None:
            buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=self.pin)
            self._pinned[key] = buffer
        used.add(key)
        return buffer.copy_(value, non_blocking=self.pin)

    def clear(self) -> None:
        """Free the pinned buffers."""
        self._pinned.clear()


def storage_addresses(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storage addresses of ``tensors`` (a DTensor's local shard), for `HostStager.stage`."""
    out = set()
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        out.add(local.untyped_storage().data_ptr())
    return out


def _shares(t: torch.Tensor, shared: set[int]) -> bool:
    address = t.untyped_storage().data_ptr()
    return address == 0 or address in shared  # an empty storage's address tells nothing: copy it


@dataclass
class WriteResult:
    """How one background write ended."""

    step: int
    path: Location | None  # the step folder, once its manifest is written
    seconds: float  # the writer thread's time: files, hashes, manifest and retention
    deleted: int = 0  # folders retention deleted
    error: BaseException | None = None


class _Gate:
    """The manifest is written only through `commit`, which refuses once `close` returned."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True

    def close(self) -> None:
        with self._lock:  # waits for a manifest being written: after this, none is
            self._open = False

    @property
    def closed(self) -> bool:
        return not self._open

    @contextmanager
    def commit(self) -> Iterator[None]:
        with self._lock:
            if not self._open:
                raise CheckpointError("the write was abandoned (the process is exiting); no manifest written")
            yield


_WRITERS: weakref.WeakSet[CheckpointWriter] = weakref.WeakSet()


@atexit.register
def _abandon_all() -> None:
    """At interpreter exit a write still running is abandoned, not finished: docs/faults.md."""
    for writer in list(_WRITERS):
        writer.abandon()


class CheckpointWriter:
    """Rank 0's checkpoint writes, one at a time, each on a daemon thread (``checkpoint-writer``).

    ``stage`` (blocking) -> ``submit`` (returns at once) -> ``wait`` (before the next ``stage``,
    which reuses the staging buffers, and for the final checkpoint). A failed write is kept in
    its `WriteResult` for the caller to raise; nothing is lost or raised on the thread.
    """

    def __init__(self) -> None:
        self.stager = HostStager()
        self._gate = _Gate()
        self._thread: threading.Thread | None = None
        self._reserving: threading.Thread | None = None
        self._result: WriteResult | None = None
        self._step: int | None = None
        self.plan: Any = None  # the staging choice (trainforge.trainer.host_memory.Plan)
        _WRITERS.add(self)

    @property
    def busy(self) -> bool:
        """A write is in flight or its result has not been taken by `wait` yet."""
        return self._thread is not None

    def reserve_in_background(self, tree: Any) -> None:
        """`HostStager.reserve` on a thread (``checkpoint-pinning``); `stage` waits for it."""
        def run() -> None:
            t0 = time.perf_counter()
            try:
                allocated = self.stager.reserve(tree)
            except Exception as err:  # noqa: BLE001 - the first save then allocates as it copies
                log.warning("could not pin host memory for checkpoints ahead of time (%s: %s); the first save "
                            "allocates it", type(err).__name__, err)
                return
            log.info("pinned %.1f GiB of host memory for checkpoint staging in %.1fs, in the background",
                     allocated / 2**30, time.perf_counter() - t0)

        self._reserving = threading.Thread(target=run, name="checkpoint-pinning", daemon=True)
        self._reserving.start()

    def stage(self, tree: Any, shared: set[int] | None = None) -> Any:
        """`HostStager.stage` into this writer's buffers.

        Raises:
            RuntimeError: the write of step N still reads the buffers (`wait` for it first).
        """
        if self.busy:
            raise RuntimeError(f"the write of step {self._step} still holds the staging buffers: wait() first")
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        return self.stager.stage(tree, shared)

    def submit(self, root: str | Path, step: int, weights: dict[str, torch.Tensor], optimizer_state: dict,
               trainer_state: dict, meta: dict, rank_files: dict[str, Any], keep_last: int,
               on_written: Callable[[Location], None] | None = None,
               on_ended: Callable[[WriteResult], None] | None = None) -> Location:
        """Write step ``step`` (staged tensors, as `checkpoint.write_checkpoint` takes them) and
        then apply retention, on the writer thread; returns the folder it is writing.

        ``on_written(folder)`` runs on the thread once the manifest is written, while the gate is
        still held: once `abandon` returned, a published manifest has been reported to it.
        ``on_ended(result)`` runs when the write ended, failed or not. Raises RuntimeError while a
        write is in flight.
        """
        if self.busy:
            raise RuntimeError(f"the write of step {self._step} is in flight: wait() first")
        folder = ckpt.step_dir(root, step)
        args = (root, step, weights, optimizer_state, trainer_state, meta, rank_files, keep_last,
                on_written, on_ended)
        self._step, self._result = step, None
        self._thread = threading.Thread(target=self._run, args=args, name="checkpoint-writer", daemon=True)
        self._thread.start()
        return folder

    def wait(self) -> WriteResult | None:
        """Block until the write in flight ends; its result (taken once), or None if there is none."""
        if self._thread is None:
            return None
        self._thread.join()
        result, self._thread, self._result = self._result, None, None
        return result

    def join(self) -> None:
        """Block until the write in flight ends, leaving its result for `wait`."""
        if self._thread is not None:
            self._thread.join()

    def abandon(self) -> None:
        """From now on no manifest is written (one being written is finished first, and its
        ``on_written`` run); the files the thread goes on writing never count. For a process that
        exits with a write in flight."""
        self._gate.close()

    def _run(self, root, step, weights, optimizer_state, trainer_state, meta, rank_files, keep_last,
             on_written, on_ended) -> None:
        # Process-directed signals must reach the main thread, whose handlers they are for.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        t0 = time.perf_counter()
        folder = ckpt.step_dir(root, step)

        @contextmanager
        def commit() -> Iterator[None]:  # the manifest and on_written under one hold of the gate
            with self._gate.commit():
                yield
                _call(on_written, folder)

        try:
            path = ckpt.write_checkpoint(root, step, weights, optimizer_state, trainer_state, meta, rank_files,
                                         commit_guard=commit)
            written_s = time.perf_counter() - t0
            _call(on_written, path)  # again when an existing complete folder was kept (no commit ran)
            deleted = ckpt.apply_retention(root, keep_last, trusted=path)  # path: hashed as written
            result = WriteResult(step, path, time.perf_counter() - t0, len(deleted))
            log.info("checkpoint %s written in the background in %.2fs (files, hashes and manifest %.2fs; "
                     "retention deleted %d)", path, result.seconds, written_s, result.deleted)
        except Exception as err:  # noqa: BLE001 - kept for the caller, who raises it (a thread cannot)
            result = WriteResult(step, None, time.perf_counter() - t0, error=err)
            if self._gate.closed or sys.is_finalizing():  # the process is exiting: not a storage fault
                log.info("background write of checkpoint step %d abandoned after %.2fs (the process is exiting; "
                         "no manifest written)", step, result.seconds)
            else:
                log.warning("background write of checkpoint step %d failed after %.2fs: %s: %s", step,
                            result.seconds, type(err).__name__, err)
        self._result = result
        _call(on_ended, result)


def _call(callback: Callable[[Any], None] | None, arg: Any) -> None:
    """A caller's bookkeeping on the writer thread: its failure is logged, never the write's."""
    if callback is None:
        return
    try:
        callback(arg)
    except Exception:  # noqa: BLE001 - bookkeeping must not hide or fail the write
        log.exception("checkpoint writer: %r failed", callback)
