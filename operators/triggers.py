"""Triggers: the asynchronous wait for a training job, run by Airflow's triggerer.

The trigger is built from plain values only (engine name, backend keyword values, the job
handle, numbers) so that Airflow can serialise it; it rebuilds its backend inside the triggerer.
Every backend call is blocking I/O, so it runs in a thread (``asyncio.to_thread``) and never on
the event loop.

Events form one closed set (:data:`EVENT_STATUSES`); each carries a human ``message`` and the
job's identity::

    {"status": "success" | "error" | "timeout" | "cancelled", "message": str,
     "job": {dag_id, run_id, task_id, try_number}, "handle": {...}, "exit_code": int | None,
     "failure": "permanent" | "transient" | None, "result": {...} | None,
     "wall_s": float | None, "log_offset": int}
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

EVENT_STATUSES = ("success", "error", "timeout", "cancelled")


class TrainingJobTrigger(BaseTrigger):
    """Poll a training job until it ends, passing rank 0's new log lines to the task log.

    Args:
        engine: backend name (``local``, ...).
        backend_kwargs: plain keyword values that rebuild the backend in the triggerer.
        handle: the job handle returned by ``Backend.submit``.
        poll_interval_s: seconds between polls (bounded to [0.5, 300]).
        deadline_epoch_s: absolute UNIX time after which a ``timeout`` event is sent.
        log_offset: byte offset of the job log already shown.
        max_log_bytes_per_poll: cap on log bytes read per poll (bounds memory for chatty jobs).
    """

    def __init__(
        self,
        engine: str,
        backend_kwargs: dict[str, Any],
        handle: dict[str, Any],
        poll_interval_s: float = 5.0,
        deadline_epoch_s: float | None = None,
        log_offset: int = 0,
        max_log_bytes_per_poll: int = 262_144,
    ):
        super().__init__()
        self.engine = engine
        self.backend_kwargs = dict(backend_kwargs)
        self.handle = dict(handle)
        self.poll_interval_s = float(min(max(poll_interval_s, 0.5), 300.0))
        self.deadline_epoch_s = deadline_epoch_s
        self.log_offset = int(log_offset)
        self.max_log_bytes_per_poll = int(max_log_bytes_per_poll)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "engine": self.engine,
                "backend_kwargs": self.backend_kwargs,
                "handle": self.handle,
                "poll_interval_s": self.poll_interval_s,
                "deadline_epoch_s": self.deadline_epoch_s,
                "log_offset": self.log_offset,
                "max_log_bytes_per_poll": self.max_log_bytes_per_poll,
            },
        )

    def _backend(self):
        from operators.backends import get_backend

        return get_backend(self.engine, **self.backend_kwargs)

    def _event(self, status: str, message: str, job_status=None) -> TriggerEvent:
        payload = {
            "status": status,
            "message": message,
            "job": self.handle.get("identity", {}),
            "handle": self.handle,
            "exit_code": getattr(job_status, "exit_code", None),
            "failure": getattr(getattr(job_status, "failure", None), "value", None),
            "result": getattr(job_status, "result", None),
            "wall_s": getattr(job_status, "wall_s", None),
            "log_offset": self.log_offset,
        }
        return TriggerEvent(payload)

    async def _pump_logs(self, backend, drain: bool = False) -> None:
        while True:
            chunk = await asyncio.to_thread(
                backend.read_logs, self.handle, self.log_offset, self.max_log_bytes_per_poll
            )
            for line in chunk.lines:
                self.log.info("[%s] %s", self.handle.get("key"), line)
            self.log_offset = chunk.next_offset
            if not drain or not chunk.lines:
                return

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from operators.backends.base import JobState

        backend = await asyncio.to_thread(self._backend)
        key = self.handle.get("key")
        while True:
            try:
                await self._pump_logs(backend)
                status = await asyncio.to_thread(backend.status, self.handle)
            except Exception as err:  # noqa: BLE001 - any engine error ends the wait as an event
                yield self._event("error", f"could not observe job {key}: {err}")
                return
            if status.state.terminal:
                await self._pump_logs(backend, drain=True)
                if status.state == JobState.SUCCEEDED:
                    yield self._event("success", f"job {key} finished: {status.message}", status)
                elif status.state == JobState.CANCELLED:
                    yield self._event("cancelled", f"job {key} was cancelled", status)
                else:
                    yield self._event(
                        "error", f"job {key} failed ({status.failure.value}): {status.message}",
                        status,
                    )
                return
            if self.deadline_epoch_s is not None and time.time() > self.deadline_epoch_s:
                yield self._event(
                    "timeout",
                    f"job {key} still {status.state.value} at its deadline "
                    f"(run timeout reached); last state: {status.message}",
                    status,
                )
                return
            await asyncio.sleep(self.poll_interval_s)
