"""The job's log is best effort in the wait: its status alone decides the event.

A fake backend stands for any engine (the trigger rebuilds its backend by name; here that lookup
returns the fake): its status is scripted, and its ``read_logs`` raises, hangs past the per-call
timeout, or trickles. The Kubernetes case, an HTTP 500 from the pod log endpoint of an emulated
API, is in test_log_best_effort_kubernetes.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from trainforge.engines.base import JobState, JobStatus, LogChunk
from trainforge.errors import BackendError
from trainforge import trigger_logs, triggers
from trainforge.triggers import TrainingJobTrigger

HANDLE = {"engine": "fake", "key": "d.r.train.1", "name": "train-job-1",
          "identity": {"dag_id": "d", "run_id": "r", "task_id": "train", "try_number": 1}}


class FakeBackend:
    """Status from ``states`` (the last one repeats); ``read_logs`` does what ``logs`` says."""

    def __init__(self, states, logs):
        self.states = list(states)
        self.logs = logs
        self.reads = 0
        self.release = threading.Event()  # ends a hanging read when the test is over

    def status(self, handle):
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return JobStatus(state, f"{state.value} now", exit_code=0 if state.terminal else None,
                         result={"final_step": 40} if state == JobState.SUCCEEDED else None)

    def read_logs(self, handle, offset, max_bytes=65_536):
        self.reads += 1
        return self.logs(self, offset, max_bytes)


def raises_once(backend, offset, max_bytes):
    if backend.reads == 1:
        raise BackendError("Kubernetes API refused to read the log of pod train-job-1-node-0-0-"
                           "abcde: HTTP 500 Internal Server Error")
    return LogChunk([f"line at {offset}"] if offset < 3 else [], min(offset + 1, 3))


def hangs(backend, offset, max_bytes):
    backend.release.wait(60)  # a response that goes silent without EOF
    return LogChunk([], offset)


def trickles(backend, offset, max_bytes):
    time.sleep(0.05)  # one more line every time it is asked, for ever
    return LogChunk(["x"], offset + 2)


def floods(backend, offset, max_bytes):
    # A backend that ignores the byte budget it is given.
    return LogChunk(["y" * 100] * 50, offset + 5050) if offset == 0 else LogChunk([], offset)


@pytest.fixture
def fake(monkeypatch):
    made = []

    def use(states, logs):
        backend = FakeBackend(states, logs)
        made.append(backend)
        monkeypatch.setattr(triggers, "get_backend", lambda engine, **kwargs: backend)
        return backend

    yield use
    for backend in made:
        backend.release.set()


def _trigger(deadline_s=None, **kwargs):
    return TrainingJobTrigger(
        engine="fake", backend_kwargs={}, handle=HANDLE, poll_interval_s=0.5,
        deadline_epoch_s=None if deadline_s is None else time.time() + deadline_s,
        log_timeout_s=0.5, **kwargs)


def _first_event(trigger, limit_s=20.0):
    async def first():
        async for event in trigger.run():
            return event.payload

    started = time.monotonic()
    payload = asyncio.run(asyncio.wait_for(first(), timeout=limit_s))
    return payload, time.monotonic() - started


def _warnings(records):
    return [r for r in records if r.get("log_level") == "warning"]


def _text(record) -> str:
    args = record.get("positional_args") or ()
    return record["event"] % args if args else record["event"]


def test_a_log_read_that_raises_once_is_a_warning_naming_job_and_pod(fake):
    from structlog.testing import capture_logs

    fake([JobState.RUNNING, JobState.RUNNING, JobState.SUCCEEDED], raises_once)
    with capture_logs() as records:
        event, _ = _first_event(_trigger())
    assert event["status"] == "success", event["message"]
    assert event["result"] == {"final_step": 40}
    warned = [_text(r) for r in _warnings(records)]
    assert len(warned) == 1
    assert "d.r.train.1" in warned[0] and "train-job-1-node-0-0-abcde" in warned[0]
    assert "HTTP 500" in warned[0]
    shown = [_text(r) for r in records if "line at" in _text(r)]
    assert shown  # the log came back once the read worked again


def test_a_hanging_log_read_does_not_hold_up_the_status(fake):
    from structlog.testing import capture_logs

    fake([JobState.RUNNING, JobState.SUCCEEDED], hangs)
    with capture_logs() as records:
        event, took = _first_event(_trigger())
    assert event["status"] == "success", event["message"]
    # One poll, one interval, the drain's bounded wait: well under the hang.
    assert took < 5.0
    warned = " ".join(_text(r) for r in _warnings(records))
    assert "d.r.train.1" in warned and "no answer within" in warned


def test_the_deadline_holds_while_the_log_read_hangs(fake):
    fake([JobState.RUNNING], hangs)
    trigger = TrainingJobTrigger(
        engine="fake", backend_kwargs={}, handle=HANDLE, poll_interval_s=0.5,
        deadline_epoch_s=time.time() + 1.5, log_timeout_s=30.0)  # the hang outlasts the deadline
    event, took = _first_event(trigger)
    assert event["status"] == "timeout" and "deadline" in event["message"]
    assert took < 4.0


def test_the_status_polls_keep_their_pace_while_a_log_read_hangs(fake):
    backend = fake([JobState.RUNNING] * 6 + [JobState.SUCCEEDED], hangs)
    calls = []
    status = backend.status
    backend.status = lambda handle: calls.append(time.monotonic()) or status(handle)
    trigger = _trigger()
    trigger.log_timeout_s = 3.0  # longer than the whole run of polls
    event, took = _first_event(trigger)
    assert event["status"] == "success"
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert len(calls) == 7 and max(gaps) < 1.0, gaps
    assert took < 7.0


def test_hanging_log_reads_do_not_pile_up(fake):
    backend = fake([JobState.RUNNING] * 10 + [JobState.SUCCEEDED], hangs)
    before = set(threading.enumerate())
    event, _ = _first_event(_trigger())
    assert event["status"] == "success"
    # Each read is given up after 0.5 s; past two hanging ones no new read starts.
    assert backend.reads == trigger_logs.MAX_ABANDONED_READS
    hanging = [t for t in set(threading.enumerate()) - before
               if t.name == "trainforge-log-read"]
    assert len(hanging) <= trigger_logs.MAX_ABANDONED_READS


def test_a_trickling_log_does_not_hold_up_the_end_of_the_wait(fake):
    backend = fake([JobState.RUNNING, JobState.SUCCEEDED], trickles)
    event, took = _first_event(_trigger())
    assert event["status"] == "success"
    assert took < 5.0 and backend.reads < 200


def test_a_backend_over_the_byte_budget_is_cut_to_it(fake):
    from structlog.testing import capture_logs

    fake([JobState.SUCCEEDED], floods)
    with capture_logs() as records:
        event, _ = _first_event(_trigger(max_log_bytes_per_poll=1_000))
    assert event["status"] == "success"
    shown = [_text(r) for r in records if "yyyy" in _text(r)]
    assert 0 < len(shown) <= 10
    assert any("over the per-poll budget" in _text(r) for r in records)


def test_wait_here_returns_while_a_log_read_still_hangs(fake):
    # The wait in the task process runs its own event loop; closing it must not wait for the
    # abandoned read.
    fake([JobState.RUNNING, JobState.SUCCEEDED], hangs)
    started = time.monotonic()
    result = {}
    waiter = threading.Thread(target=lambda: result.update(_trigger().wait_here()), daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), "wait_here did not return"
    assert result["status"] == "success" and time.monotonic() - started < 10


def test_a_status_error_still_ends_the_wait(fake):
    backend = fake([JobState.RUNNING], hangs)

    def broken(handle):
        raise BackendError("engine unreachable")

    backend.status = broken
    event, _ = _first_event(_trigger())
    assert event["status"] == "error" and "engine unreachable" in event["message"]


def test_log_timeout_round_trips():
    classpath, kwargs = _trigger().serialize()
    assert kwargs["log_timeout_s"] == 0.5
    assert TrainingJobTrigger(**kwargs).serialize() == (classpath, kwargs)
