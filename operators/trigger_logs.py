"""Following a job's log for the trigger: best effort, never in the way of the wait.

Each :meth:`JobLogFollower.pump` reads the log lines since the last offset (at most
``max_bytes_per_poll``) and waits for them until the given time, never past the deadline. A read
runs in a daemon thread of its own, one at a time; one still running at the next call is waited
on again, and given up (a warning) once it has run ``timeout_s``. A read that fails is a warning
naming the job (and the pod, where the engine's error does), never an error of the wait. A
finished job's last lines are read within ``timeout_s`` in all (a failed read is tried again, a
few times, after a pause).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

# A log read that has kept failing is warned about again after this many seconds, not per poll.
LOG_WARNING_EVERY_S = 60.0
# At most this many reads when the last lines of a finished job are read (within log_timeout_s).
MAX_DRAIN_READS = 64
# Given-up log reads whose threads still run, at most; past it no new read starts.
MAX_ABANDONED_READS = 2
# ...of which this many may fail, each after a pause, before the last lines are given up.
DRAIN_RETRIES = 3
DRAIN_RETRY_PAUSE_S = 0.5


def _in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread of its own; a future of the running loop for its result.

    Unlike ``asyncio.to_thread`` the thread belongs to no executor: a call that never returns
    holds up neither the executor's other work nor ``asyncio.run``'s shutdown, which joins the
    default executor's threads (:meth:`TrainingJobTrigger.wait_here`).
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, err: BaseException | None) -> None:
        if future.done():
            return
        if err is None:
            future.set_result(value)
        else:
            future.set_exception(err)

    def work() -> None:
        value, err = None, None
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            err = exc
        try:
            loop.call_soon_threadsafe(settle, value, err)
        except RuntimeError:
            pass  # the loop is closed: the wait ended without this call's answer

    threading.Thread(target=work, name="trainforge-log-read", daemon=True).start()
    return future


class JobLogFollower:
    """Rank 0's log of one job, passed line by line to ``log`` (the task log).

    Args:
        handle: the job handle (``key``, ``name`` name the job in warnings).
        log: where the lines and warnings go, asked at each use (the triggerer binds a trigger's
            logger to its task's log once the trigger runs).
        offset: byte offset of the log already shown.
        max_bytes_per_poll: cap on log bytes read and shown per call.
        timeout_s: seconds one read may run before it is given up.
    """

    def __init__(self, handle: dict[str, Any], log: Callable[[], logging.Logger | Any],
                 offset: int, max_bytes_per_poll: int, timeout_s: float) -> None:
        self.handle = handle
        self._log = log
        self.offset = offset
        self.max_bytes_per_poll = max_bytes_per_poll
        self.timeout_s = timeout_s
        self._read: asyncio.Future | None = None  # a read still in flight
        self._read_started_s = 0.0
        self._abandoned: set[asyncio.Future] = set()  # given-up reads whose threads still run
        self._trouble: str | None = None  # why the last read failed
        self._trouble_since = 0.0
        self._warned_at = 0.0
        self._failures = 0

    async def pump(self, backend: Any, until_s: float, deadline_epoch_s: float | None,
                   drain: bool = False) -> None:
        """Pass the job's new log lines to the task log; best effort, never raises.

        Waits until ``until_s`` (``time.monotonic()``; the next poll's time, or for ``drain``
        the end of the last lines' reads) at the latest, and never past the deadline. A read
        still running then stays in flight and is waited on again at the next call; once it has
        run ``log_timeout_s`` it is given up (warned) and the next call starts a new one, unless
        :data:`MAX_ABANDONED_READS` given-up reads still hang.
        """
        if deadline_epoch_s is not None:
            until_s = min(until_s, time.monotonic() + deadline_epoch_s - time.time())
        failed_reads = 0
        for _ in range(MAX_DRAIN_READS if drain else 1):
            if self._read is None:
                self._abandoned = {read for read in self._abandoned if not read.done()}
                if len(self._abandoned) >= MAX_ABANDONED_READS:
                    self._failed(f"{len(self._abandoned)} earlier log reads still hang; "
                                     f"no new read until one of them ends")
                    return
                self._read = _in_daemon_thread(
                    backend.read_logs, self.handle, self.offset, self.max_bytes_per_poll)
                self._read_started_s = time.monotonic()
            gives_up_s = self._read_started_s + self.timeout_s
            left_s = max(0.0, min(until_s, gives_up_s) - time.monotonic())
            done, _ = await asyncio.wait({self._read}, timeout=left_s)
            if not done:
                if time.monotonic() < gives_up_s:
                    return  # still within its time: waited on again at the next poll
                self.abandon_read()
                self._failed(f"no answer within {self.timeout_s:g} s")
                failed_reads += 1
                if not drain or failed_reads >= DRAIN_RETRIES or time.monotonic() >= until_s:
                    return
                continue
            read, self._read = self._read, None
            try:
                chunk = read.result()
            except Exception as err:  # noqa: BLE001 - logs are best effort
                self._failed(f"{type(err).__name__}: {err}")
                failed_reads += 1
                left = until_s - time.monotonic()
                if not drain or failed_reads >= DRAIN_RETRIES or left <= 0:
                    return
                # The finished job's last lines matter most: try again after a pause.
                await asyncio.sleep(min(DRAIN_RETRY_PAUSE_S, left))
                continue
            self._recovered()
            self._show(chunk.lines)
            self.offset = chunk.next_offset
            if not drain or not chunk.lines or time.monotonic() >= until_s:
                return

    def abandon_read(self) -> None:
        """Give up the read in flight: its late answer (or error) is dropped without a word."""
        read, self._read = self._read, None
        if read is not None:
            read.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._abandoned.add(read)

    def _show(self, lines: list[str]) -> None:
        """Log ``lines`` into the task log, up to ``max_log_bytes_per_poll`` of them."""
        key = self.handle.get("key")
        used = 0
        for n, line in enumerate(lines):
            size = len(line.encode("utf-8", errors="replace")) + 1
            if used + size > self.max_bytes_per_poll:
                if used == 0:  # a single line over the budget: its head
                    self._log().info("[%s] %s...", key, line[: self.max_bytes_per_poll])
                    n += 1
                skipped = lines[n:]
                if skipped:
                    self._log().warning(
                        "Job %s: %d log lines (%d bytes) not shown: over the per-poll budget of "
                        "%d bytes", key, len(skipped), sum(len(x) + 1 for x in skipped),
                        self.max_bytes_per_poll)
                return
            used += size
            self._log().info("[%s] %s", key, line)

    def _job_name(self) -> str:
        key, name = self.handle.get("key"), self.handle.get("name")
        return f"{key} ({name})" if name and name != key else str(key)

    def _failed(self, why: str) -> None:
        """A warning for a failed or silent log read: the first of a streak, then once every
        :data:`LOG_WARNING_EVERY_S`."""
        now = time.monotonic()
        self._failures += 1
        if self._trouble is None:
            self._trouble_since = now
        first = self._trouble is None or why != self._trouble
        self._trouble = why
        if not first and now - self._warned_at < LOG_WARNING_EVERY_S:
            return
        self._warned_at = now
        streak = "" if self._failures == 1 else (
            f" ({self._failures} failed reads over {now - self._trouble_since:.0f} s)")
        self._log().warning("Job %s: could not read its log: %s%s; the wait goes on by the job's "
                         "status", self._job_name(), why, streak)

    def _recovered(self) -> None:
        if self._trouble is not None:
            self._log().info("Job %s: its log reads again after %d failed reads",
                          self._job_name(), self._failures)
        self._trouble, self._failures = None, 0
