"""Submitting a try's job: a job the engine refuses as invalid fails the task without retries
(a retry would send the same request and be refused again)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from trainforge.cluster_job import ClusterJobOperator
from trainforge.engines.base import TrainingJob
from trainforge.errors import BackendError, JobRefusedError
from trainforge.pipeline.loader import load_spec

SPEC = Path(__file__).resolve().parents[1] / "faults" / "fault_tiny.yaml"
REFUSAL = ('Kubernetes API refused to create TrainJob t: HTTP 422 Invalid: TrainJob "t" is '
           "invalid: spec.trainer.numNodes: Invalid value: 0")


class _Backend:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.submitted = 0

    def find(self, identity):
        return None

    def submit(self, job):
        self.submitted += 1
        raise self.error


class _Operator(ClusterJobOperator):
    backend_under_test: _Backend

    def prepare_job(self, context, spec, identity):
        return TrainingJob(identity=identity, config={}, module="trainforge.trainer.train"), {}

    def job_succeeded(self, context, spec, event, **job_kwargs):
        raise AssertionError("a refused or unreachable job never succeeds")

    def backend(self, spec):
        return self.backend_under_test


def _execute(error: Exception) -> _Backend:
    op = _Operator(task_id="train", spec=load_spec(SPEC).model_dump(mode="json"))
    op.backend_under_test = _Backend(error)
    ti = SimpleNamespace(dag_id="d", run_id="r", task_id="train", try_number=1)
    try:
        op.execute({"ti": ti, "params": {}})
    finally:
        assert op.backend_under_test.submitted == 1
    return op.backend_under_test


def test_a_job_the_engine_refuses_fails_the_task_permanently_with_the_reason():
    with pytest.raises(AirflowFailException, match="HTTP 422 .*spec.trainer.numNodes"):
        _execute(JobRefusedError(REFUSAL))


def test_an_engine_that_cannot_be_reached_stays_a_retryable_failure():
    with pytest.raises(BackendError) as err:
        _execute(BackendError("Kubernetes API unreachable: connection refused"))
    assert not isinstance(err.value, AirflowFailException)


def test_a_task_that_does_not_say_what_job_it_runs_cannot_be_built():
    class Incomplete(ClusterJobOperator):
        def prepare_job(self, context, spec, identity):
            return None, {}

    with pytest.raises(TypeError, match="job_succeeded"):
        Incomplete(task_id="train", spec=load_spec(SPEC).model_dump(mode="json"))
