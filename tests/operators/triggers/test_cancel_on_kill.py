"""Cancel on kill, decided by the task's state: real local jobs, the trigger run on an event loop.

Airflow's triggerer cancels a trigger's task both when a user acts on the deferred task and when
it restarts or moves the trigger; only the task instance's state tells the two apart. Here the
state comes from a subclass (the task-state lookup is the one piece that needs a triggerer; the
real-triggerer path is in tests/faults/test_standalone_faults.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.local.backend import LocalBackend
from trainforge.triggers import TrainingJobTrigger

FAKE_DIR = Path(__file__).resolve().parents[1] / "engines"


class StateTrigger(TrainingJobTrigger):
    """The trigger with a fixed answer for the task instance's state (or an error)."""

    state: str | None | Exception = "deferred"

    async def task_state(self):
        if isinstance(self.state, Exception):
            raise self.state
        return self.state


def _long_job(tmp_path):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKE_DIR))
    handle = backend.submit(TrainingJob(
        identity=JobIdentity("d", "r", "train", 1), config={"fake": {"lines": 1, "sleep_s": 120}},
        module="fake_trainer",
    ))
    return backend, handle


def _cancel_while_waiting(trigger, via_on_kill=False):
    """Start ``trigger.run()``, let it poll, cancel it like the triggerer does, then on_kill."""

    async def scenario():
        async def consume():
            async for _ in trigger.run():
                return

        task = asyncio.create_task(consume())
        await asyncio.sleep(1.5)
        task.cancel("__airflow_user_action__" if via_on_kill else None)
        with pytest.raises(asyncio.CancelledError):
            await task
        if via_on_kill:
            await trigger.on_kill()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def _trigger(tmp_path, handle, state, cancel_on_kill=True):
    trigger = StateTrigger(engine="local", backend_kwargs={"runs_root": str(tmp_path / "runs")},
                           handle=handle, poll_interval_s=0.5, cancel_on_kill=cancel_on_kill,
                           cancel_grace_s=5)
    trigger.state = state
    return trigger


@pytest.mark.parametrize("state", ["failed", "success", "scheduled", "up_for_retry"])
def test_task_no_longer_deferred_cancels_the_job_and_says_so(tmp_path, state):
    from structlog.testing import capture_logs

    backend, handle = _long_job(tmp_path)
    with capture_logs() as records:
        _cancel_while_waiting(_trigger(tmp_path, handle, state), via_on_kill=True)
    assert backend.status(handle).state == JobState.CANCELLED
    text = " ".join(str(r.get("event")) % tuple(r.get("positional_args") or ()) for r in records)
    assert f"the task is now {state}" in text and "cancelling job" in text


@pytest.mark.parametrize(
    "state",
    ["deferred", "running", None, RuntimeError("execution API unreachable")],
    ids=["still-deferred (triggerer restart)", "running (a task process owns the job)",
         "no task instance", "state unreadable"],
)
def test_healthy_job_survives_a_trigger_cancellation(tmp_path, state):
    backend, handle = _long_job(tmp_path)
    try:
        _cancel_while_waiting(_trigger(tmp_path, handle, state))
        time.sleep(0.5)
        assert backend.status(handle).state == JobState.RUNNING
        # The same trigger running again (a second triggerer) does not submit or cancel either.
        _cancel_while_waiting(_trigger(tmp_path, handle, state))
        assert backend.status(handle).state == JobState.RUNNING
        assert len(list((tmp_path / "runs").iterdir())) == 1
    finally:
        backend.cancel(handle, grace_s=5)


def test_cancel_on_kill_false_keeps_the_job(tmp_path):
    backend, handle = _long_job(tmp_path)
    try:
        _cancel_while_waiting(_trigger(tmp_path, handle, "failed", cancel_on_kill=False),
                              via_on_kill=True)
        assert backend.status(handle).state == JobState.RUNNING
    finally:
        backend.cancel(handle, grace_s=5)


def test_task_state_is_none_outside_a_triggerer(tmp_path):
    trigger = TrainingJobTrigger(engine="local", backend_kwargs={"runs_root": str(tmp_path)},
                                 handle={"key": "k"})
    assert asyncio.run(trigger.task_state()) is None
    assert asyncio.run(trigger.safe_to_cancel()) is False
