"""TrainingJobTrigger: round-trips through Airflow's serializer, and waits on real local jobs."""

from __future__ import annotations

import asyncio
import importlib
import time
from pathlib import Path

import pytest

from trainforge.engines.base import JobIdentity, TrainingJob
from trainforge.engines.local.backend import LocalBackend
from trainforge.triggers import EVENT_STATUSES, TrainingJobTrigger

FAKE_DIR = Path(__file__).resolve().parents[1] / "engines"

ALL_TRIGGERS = [
    TrainingJobTrigger(
        engine="local",
        backend_kwargs={"runs_root": "/x/runs"},
        handle={
            "engine": "local",
            "key": "k",
            "job_dir": "/x/runs/k",
            "identity": {"dag_id": "d", "run_id": "r", "task_id": "train", "try_number": 1},
        },
        poll_interval_s=2.0,
        deadline_epoch_s=1_900_000_000.0,
        log_offset=17,
        cancel_on_kill=False,
        cancel_grace_s=12.0,
        deadline_reason="execution_timeout",
    ),
]


@pytest.mark.parametrize("trigger", ALL_TRIGGERS, ids=lambda t: type(t).__name__)
def test_every_trigger_round_trips_through_airflows_serializer(trigger):
    from airflow.serialization.serialized_objects import BaseSerialization

    classpath, kwargs = trigger.serialize()
    encoded = BaseSerialization.serialize(kwargs)
    decoded = BaseSerialization.deserialize(encoded)
    module, _, name = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**decoded)
    assert rebuilt.serialize() == (classpath, kwargs)


def _collect(trigger):
    async def first_event():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(asyncio.wait_for(first_event(), timeout=90))


def _submit(tmp_path, fake, nproc=1, try_number=1):
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKE_DIR))
    identity = JobIdentity("d", "r", "train", try_number)
    handle = backend.submit(
        TrainingJob(
            identity=identity,
            config={"fake": fake},
            module="fake_trainer",
            processes_per_node=nproc,
        )
    )
    return backend, handle


def _trigger(tmp_path, handle, deadline=None):
    return TrainingJobTrigger(
        engine="local",
        backend_kwargs={"runs_root": str(tmp_path / "runs")},
        handle=handle,
        poll_interval_s=0.5,
        deadline_epoch_s=deadline,
    )


def test_success_event_carries_identity_and_result_and_logs_reach_the_task_log(tmp_path):
    from structlog.testing import capture_logs

    _, handle = _submit(tmp_path, {"lines": 5, "line_sleep_s": 0.2, "result_status": "success"})
    # Airflow routes a trigger's structlog output into the deferred task's log.
    with capture_logs() as records:
        event = _collect(_trigger(tmp_path, handle))
    assert event["status"] == "success" and event["status"] in EVENT_STATUSES
    assert event["job"] == {"dag_id": "d", "run_id": "r", "task_id": "train", "try_number": 1}
    assert event["result"]["final_step"] == 7
    logged = [r for r in records if "rank0 line" in str(r.get("positional_args") or r["event"])]
    assert len(logged) == 5


def test_permanent_failure_event(tmp_path):
    _, handle = _submit(
        tmp_path,
        {"exit_code": 78, "result_status": "bad_config", "message": "optim.max_steps must be >= 1"},
    )
    event = _collect(_trigger(tmp_path, handle))
    assert event["status"] == "error" and event["failure"] == "permanent"
    assert "max_steps" in event["message"]


def test_deadline_gives_a_timeout_event_and_leaves_the_job_to_the_operator(tmp_path):
    backend, handle = _submit(tmp_path, {"lines": 1, "sleep_s": 60})
    event = _collect(_trigger(tmp_path, handle, deadline=time.time() + 1.5))
    assert event["status"] == "timeout" and "deadline" in event["message"]
    # The trigger never cancels: a triggerer restart must not kill a healthy job.
    assert backend.status(handle).state.value == "running"
    assert backend.cancel(handle, grace_s=5).state.value == "cancelled"


def test_cancelled_job_gives_a_cancelled_event(tmp_path):
    backend, handle = _submit(tmp_path, {"lines": 1, "sleep_s": 60})
    time.sleep(1.0)
    backend.cancel(handle, grace_s=5)
    event = _collect(_trigger(tmp_path, handle))
    assert event["status"] == "cancelled"
