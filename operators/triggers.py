"""Triggers: the asynchronous wait for a training job, run by Airflow's triggerer.

:class:`TrainingJobTrigger` polls the job's backend (in a thread, never on the event loop),
passes rank 0's new log lines on, and ends with one event of a closed set
(:data:`EVENT_STATUSES`). When the trigger is cancelled it cancels the job only when the task is
no longer ``deferred`` (never on a triggerer restart; never with ``cancel_on_kill=False``);
:meth:`TrainingJobTrigger.wait_here` runs the same coroutine in the task process
(``fault.deferrable: false``), where the task's ``on_kill`` decides about the job instead.

The job's status alone decides the event; its log is best effort
(:class:`~trainforge.trigger_logs.JobLogFollower`): a log that fails, hangs or trickles delays
neither the status polls, nor the deadline, nor the end of the wait.

Serialisation, cancel on kill, the wait in the task process and the events' fields: see
docs/faults.md, "The launch, inside".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from trainforge.engines.descriptors import get_backend
from trainforge.engines.base import JobState
from trainforge.errors import TriggerEventError
from trainforge.trigger_logs import JobLogFollower

EVENT_STATUSES = ("success", "error", "timeout", "cancelled")

# How long the task-state lookup on cancellation may take before we give up and keep the job.
# The triggerer answers it through its in-process API server, which can take seconds to warm up
# on a busy machine; the trigger warms it up when it starts (see `_wait`).
STATE_LOOKUP_TIMEOUT_S = 25.0

class TrainingJobTrigger(BaseTrigger):
    """Poll a training job until it ends, passing rank 0's new log lines to the task log.

    Args:
        engine: backend name (``local``, ...).
        backend_kwargs: plain keyword values that rebuild the backend in the triggerer.
        handle: the job handle returned by ``Backend.submit``.
        poll_interval_s: seconds between polls (bounded to [0.5, 300]).
        deadline_epoch_s: absolute UNIX time after which a ``timeout`` event is sent.
        log_offset: byte offset of the job log already shown.
        max_log_bytes_per_poll: cap on log bytes read per poll (bounds memory for chatty jobs);
            lines beyond it that a backend returns anyway are not shown.
        log_timeout_s: seconds one log read may run before it is given up with a warning (and,
            for a finished job, all reads of its last lines together); polls do not wait on it.
        cancel_on_kill: cancel the job when the task is killed while deferred (see module doc).
        cancel_grace_s: seconds between the polite stop and the forced one when cancelling.
        deadline_reason: what ``deadline_epoch_s`` is (``run_timeout`` of the job or the task's
            ``execution_timeout``); carried into the ``timeout`` event.
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
        cancel_on_kill: bool = True,
        cancel_grace_s: float = 20.0,
        deadline_reason: str | None = None,
        log_timeout_s: float = 10.0,
    ):
        super().__init__()
        self.engine = engine
        self.backend_kwargs = dict(backend_kwargs)
        self.handle = dict(handle)
        self.poll_interval_s = float(min(max(poll_interval_s, 0.5), 300.0))
        self.deadline_epoch_s = deadline_epoch_s
        self.max_log_bytes_per_poll = int(max_log_bytes_per_poll)
        self.cancel_on_kill = bool(cancel_on_kill)
        self.cancel_grace_s = float(cancel_grace_s)
        self.deadline_reason = deadline_reason
        self.log_timeout_s = float(log_timeout_s)
        self._kill_handled = False
        self._logs = JobLogFollower(self.handle, lambda: self.log, int(log_offset),
                                    int(max_log_bytes_per_poll), float(log_timeout_s))
        self._in_task_process = False

    @property
    def log_offset(self) -> int:
        """Byte offset of the job log shown so far (carried into events and re-serialisation)."""
        return self._logs.offset

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
                "cancel_on_kill": self.cancel_on_kill,
                "cancel_grace_s": self.cancel_grace_s,
                "deadline_reason": self.deadline_reason,
                "log_timeout_s": self.log_timeout_s,
            },
        )

    def _backend(self):
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
            "ended_at_epoch_s": getattr(job_status, "ended_at_epoch_s", None),
            "phases": getattr(job_status, "phases", None),
            "log_offset": self.log_offset,
            "deadline_reason": self.deadline_reason,
        }
        return TriggerEvent(payload)

    def wait_here(self) -> dict[str, Any]:
        """Run this trigger's wait in the calling process until its first event; its payload.

        For a task that waits in its worker slot (``fault.deferrable: false``): the same polls,
        log lines, deadline and events as in the triggerer, on an event loop of its own
        (``asyncio.run``; the caller must not be inside a running loop). An exception raised
        into the loop (Airflow's ``AirflowTaskTimeout`` from SIGALRM, a kill) propagates out
        after the loop is torn down; the job is left to the task's ``on_kill``.

        Raises:
            TriggerEventError: the wait ended without an event (never expected).
        """
        self._in_task_process = True

        async def first_event() -> dict[str, Any]:
            async for event in self.run():
                return event.payload
            raise TriggerEventError(f"the wait for job {self.handle.get('key')} ended without "
                                    f"an event")

        return asyncio.run(first_event())

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # In the triggerer, the first state lookup warms up the API path, so that the one made
        # on cancellation answers within its timeout. A task process has nothing to ask.
        warm_up = None if self._in_task_process else asyncio.create_task(self._log_task_state())
        try:
            async for event in self._wait():
                yield event
        except asyncio.CancelledError:
            await self._cancel_job_if_task_killed("trigger cancelled")
            raise
        finally:
            if warm_up is not None:
                warm_up.cancel()

    async def _log_task_state(self) -> None:
        try:
            state = await self.task_state()
        except Exception as err:  # noqa: BLE001 - only a log line
            self.log.info("Job %s: task state not readable yet (%s)", self.handle.get("key"), err)
            return
        if state is not None:
            self.log.info("Waiting on job %s for a task in state %s", self.handle.get("key"), state)

    async def on_kill(self) -> None:
        """Airflow 3.3+: called by the triggerer when a user acted on the deferred task."""
        await self._cancel_job_if_task_killed("user action on the task")

    # -- cancel on kill ---------------------------------------------------------------------
    async def task_state(self) -> str | None:
        """The deferred task instance's current state in Airflow (``"deferred"``, ``"failed"``...).

        Read through the Task SDK (``RuntimeTaskInstance.get_task_states``), which the
        triggerer proxies to the Airflow API. ``"none"`` for a task instance without a state
        (just cleared); None when the trigger runs outside a triggerer (no task instance) or
        the task instance no longer exists.

        Raises:
            Exception: whatever the API call raised (the caller keeps the job on any doubt).
        """
        ti = getattr(self, "task_instance", None)
        if ti is None:
            return None
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        states = await asyncio.to_thread(
            RuntimeTaskInstance.get_task_states,
            dag_id=ti.dag_id,
            task_ids=[ti.task_id],
            run_ids=[ti.run_id],
            map_index=getattr(ti, "map_index", -1),
        )
        of_run = (states or {}).get(ti.run_id, {})
        if ti.task_id not in of_run:
            return None
        state = of_run[ti.task_id]
        # A cleared task instance has no state until the scheduler picks it up again.
        return "none" if state is None else str(getattr(state, "value", state))

    async def safe_to_cancel(self) -> bool:
        """True when the task is no longer deferred, i.e. the job's waiter is gone for good.

        False when the task is still ``deferred`` (a triggerer restart or a trigger moved to
        another triggerer), when it is ``running`` (a task process owns the job), when there is
        no task instance to ask, and when the state cannot be read within
        :data:`STATE_LOOKUP_TIMEOUT_S`: a healthy job is never cancelled on doubt.
        """
        key = self.handle.get("key")
        try:
            state = await asyncio.wait_for(self.task_state(), STATE_LOOKUP_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - on any doubt, keep the job
            what = f"no answer within {STATE_LOOKUP_TIMEOUT_S:.0f} s" if isinstance(
                err, TimeoutError) else f"{type(err).__name__}: {err}"
            self.log.warning("Job %s: could not read the task's state (%s); keeping the job",
                             key, what)
            return False
        if state is None:
            self.log.info("Job %s: no task instance to ask; keeping the job", key)
            return False
        if state == "deferred":
            self.log.info("Job %s: the task is still deferred (triggerer restart or trigger "
                          "moved); keeping the job", key)
            return False
        if state == "running":
            # A task process waits on the job again (it resumed, or waits in its worker slot):
            # its on_kill decides about the job, not this trigger.
            self.log.info("Job %s: the task is running in a worker, which owns the job now; "
                          "keeping the job", key)
            return False
        self.log.info("Job %s: the task is now %s", key, state)
        return True

    async def _cancel_job_if_task_killed(self, why: str) -> None:
        key = self.handle.get("key")
        if self._kill_handled:
            return
        if self._in_task_process:
            # The loop is torn down by the task process's own exception: its on_kill decides.
            self._kill_handled = True
            self.log.info("Wait for job %s in the task process stopped; the task's on_kill "
                          "decides about the job", key)
            return
        if not self.cancel_on_kill:
            self._kill_handled = True
            self.log.info("Trigger for job %s stopped (%s); cancel_on_kill is false: keeping the "
                          "job", key, why)
            return
        if not await self.safe_to_cancel():
            return  # a later call (on_kill after run's cancellation) may ask again
        self._kill_handled = True
        self.log.warning("Task killed while deferred (%s): cancelling job %s (grace %.0f s)",
                         why, key, self.cancel_grace_s)
        try:
            backend = await asyncio.to_thread(self._backend)
            status = await asyncio.to_thread(backend.cancel, self.handle, self.cancel_grace_s)
        except Exception as err:  # noqa: BLE001 - report, never raise out of a cancellation
            self.log.error("Could not cancel job %s: %s", key, err)
            return
        self.log.warning("Job %s cancelled: now %s", key, status.state.value)

    # -- the wait ---------------------------------------------------------------------------
    async def _wait(self) -> AsyncIterator[TriggerEvent]:
        backend = await asyncio.to_thread(self._backend)
        key = self.handle.get("key")
        try:
            async for event in self._polls(backend, key):
                yield event
        finally:
            self._logs.abandon_read()

    async def _polls(self, backend, key) -> AsyncIterator[TriggerEvent]:
        while True:
            next_poll_s = time.monotonic() + self.poll_interval_s
            try:
                status = await asyncio.to_thread(backend.status, self.handle)
            except Exception as err:  # noqa: BLE001 - any engine error ends the wait as an event
                yield self._event("error", f"could not observe job {key}: {err}")
                return
            if status.state.terminal:
                await self._logs.pump(backend, time.monotonic() + self.log_timeout_s,
                                      self.deadline_epoch_s, drain=True)
            else:
                await self._logs.pump(backend, next_poll_s, self.deadline_epoch_s)
            if status.state.terminal:
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
            if self.deadline_epoch_s is not None and time.time() >= self.deadline_epoch_s:
                reason = self.deadline_reason or "run_timeout"
                yield self._event(
                    "timeout",
                    f"job {key} still {status.state.value} at its deadline "
                    f"({reason} reached); last state: {status.message}",
                    status,
                )
                return
            pause = max(0.0, next_poll_s - time.monotonic())
            if self.deadline_epoch_s is not None:
                pause = min(pause, max(0.0, self.deadline_epoch_s - time.time()))
            await asyncio.sleep(pause)
