"""The DAG's callbacks against a real MLflow server: a task that fails for good ends the DAG run's
MLflow run FAILED; each callback acts once per (DAG run, task, try), so a repeated delivery, or
one for a try older than the newest that began, changes nothing; a later try that succeeds takes
the failure back, and so does ``close_run`` for a task that succeeded without a callback."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainforge.callbacks import clear_failure_on_success, close_mlflow_run_on_failure
from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.mlflow_runs import TAG_STAGE
from trainforge.pipeline import load_spec
from trainforge.pipeline.spec import PipelineSpec
from trainforge.tasks.close_run import CloseRunOperator
from trainforge.tasks.train import TrainOperator
from trainforge.tasks.validate_checkpoint import ValidateCheckpointOperator

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"
TINY = ROOT / "tests" / "faults" / "fault_tiny.yaml"
RUN = "manual__callback-test"
ALL_SUCCEEDED = dict.fromkeys(["prepare_data", "train", "validate_checkpoint",
                               "register_model"], "success")
REGISTERED = {"register_model": {"version": "1"}}

pytestmark = pytest.mark.integration


class FakeTI:
    """What the callbacks and the operators read of Airflow's task instance of one try."""

    def __init__(self, dag_id: str, task_id: str, try_number: int):
        self.dag_id, self.run_id, self.task_id, self.try_number = dag_id, RUN, task_id, try_number

    def xcom_push(self, key, value):
        pass


def _raw(path=DEMO, stages=None):
    raw = load_spec(path).model_dump(mode="json")
    raw["pipeline"]["mlflow_experiment"] = f"callbacks-{time.time_ns()}"
    if stages:
        raw["stages"] = [{"name": name} for name in stages]
    return raw


def _tries(op, spec, tries):
    """The context of each try of task ``op``; each try records its start as the task does."""
    contexts = {}
    for n in tries:
        contexts[n] = {"ti": FakeTI(spec.dag_id, op.task_id, n), "task": op, "params": {}}
        run_id = op.mlflow_run_id(contexts[n], spec)
    return run_id, contexts


def _failure_tags(run) -> list[str]:
    return sorted(k for k in run.data.tags if k.startswith(("trainforge.failed_task",
                                                            "trainforge.killed_task")))


def test_failure_callback_ends_the_run_failed_and_names_the_task(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    spec = load_spec(DEMO)
    hook = MlflowHook(tracking_uri=mlflow_server)
    run_id = hook.get_or_create_run(spec.experiment_name, spec.dag_id, RUN)
    context = {
        "ti": SimpleNamespace(dag_id=spec.dag_id, run_id=RUN, task_id="train", try_number=1),
        "task": SimpleNamespace(spec=spec.model_dump(mode="json")),
    }
    close_mlflow_run_on_failure(context)
    run = hook.client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["trainforge.failed_task"] == "train"


def test_failure_callback_never_raises_even_without_a_server(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    spec = load_spec(DEMO)
    context = {"ti": SimpleNamespace(dag_id=spec.dag_id, run_id="r", task_id="train",
                                     try_number=1),
               "task": SimpleNamespace(spec=spec.model_dump(mode="json"))}
    close_mlflow_run_on_failure(context)  # logs a warning, raises nothing
    clear_failure_on_success(context)


def test_try_1s_failure_delivered_three_times_while_try_2_trains_changes_nothing(
        mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # the callbacks' hook
    raw = _raw()
    spec = PipelineSpec.model_validate(raw)
    hook = MlflowHook(tracking_uri=mlflow_server)
    train = TrainOperator(task_id="train", spec=raw, mlflow_tracking_uri=mlflow_server)
    run_id, ctx = _tries(train, spec, [1, 2])  # try 1's worker was lost; try 2 trains
    for _ in range(3):  # the heartbeat check found try 1 gone three times
        close_mlflow_run_on_failure(ctx[1])
        run = hook.get_run(run_id)
        assert run.info.status == "RUNNING" and _failure_tags(run) == []
    clear_failure_on_success(ctx[2])  # try 2 succeeded; the pipeline goes on to the end
    report = CloseRunOperator(task_id="close_run", spec=raw, mlflow_tracking_uri=mlflow_server
                              ).close(spec, spec.dag_id, RUN, ALL_SUCCEEDED, REGISTERED)
    assert report.ended_runs == {run_id: "FINISHED"} and report.problems == []
    run = hook.get_run(run_id)
    assert run.info.status == "FINISHED" and _failure_tags(run) == []


def test_a_repeated_failure_delivery_for_the_newest_try_acts_once(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    raw = _raw()
    spec = PipelineSpec.model_validate(raw)
    hook = MlflowHook(tracking_uri=mlflow_server)
    train = TrainOperator(task_id="train", spec=raw, mlflow_tracking_uri=mlflow_server)
    run_id, ctx = _tries(train, spec, [1])
    close_mlflow_run_on_failure(ctx[1])
    first = hook.get_run(run_id)
    assert first.info.status == "FAILED" and first.data.tags["trainforge.failed_task"] == "train"
    time.sleep(0.05)  # a second end would carry a later end time
    close_mlflow_run_on_failure(ctx[1])
    close_mlflow_run_on_failure(ctx[1])
    again = hook.get_run(run_id)
    assert (again.info.status, again.info.end_time) == ("FAILED", first.info.end_time)
    assert again.data.tags["trainforge.callback.train.1"] == "failure"


def test_a_later_try_that_succeeds_takes_the_failure_back(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    raw = _raw()
    spec = PipelineSpec.model_validate(raw)
    hook = MlflowHook(tracking_uri=mlflow_server)
    validate = ValidateCheckpointOperator(task_id="validate_checkpoint", spec=raw,
                                          mlflow_tracking_uri=mlflow_server)
    run_id, ctx = _tries(validate, spec, [1])
    close_mlflow_run_on_failure(ctx[1])  # try 1 failed for good
    ended = hook.get_run(run_id)
    assert ended.info.status == "FAILED"
    _, later = _tries(validate, spec, [2])  # cleared by hand: try 2 runs
    time.sleep(0.05)
    close_mlflow_run_on_failure(ctx[1])  # try 1's failure delivered again, late
    assert hook.get_run(run_id).info.end_time == ended.info.end_time
    clear_failure_on_success(later[2])
    run = hook.get_run(run_id)
    assert run.info.status == "RUNNING" and _failure_tags(run) == []
    assert run.data.tags["trainforge.callback.validate_checkpoint.2"] == "success"
    close_mlflow_run_on_failure(ctx[1])  # and again: the failure stays taken back
    assert hook.get_run(run_id).info.status == "RUNNING"
    CloseRunOperator(task_id="close_run", spec=raw, mlflow_tracking_uri=mlflow_server
                     ).close(spec, spec.dag_id, RUN, ALL_SUCCEEDED, REGISTERED)
    assert hook.get_run(run_id).info.status == "FINISHED"


def test_a_stage_that_succeeds_on_its_next_try_takes_back_its_failure_tags(
        mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    raw = _raw(TINY, stages=["a", "b"])
    spec = PipelineSpec.model_validate(raw)
    hook = MlflowHook(tracking_uri=mlflow_server)
    op = TrainOperator(task_id="train_a", spec=raw, mlflow_tracking_uri=mlflow_server, stage="a")
    parent, ctx = _tries(op, spec, [1])
    child = op._stage_run_id(spec, parent)
    close_mlflow_run_on_failure(ctx[1])
    assert hook.get_run(child).data.tags["trainforge.failed_task"] == "train_a"
    assert hook.get_run(parent).data.tags["trainforge.failed_task.train_a"] == "failed"
    _, later = _tries(op, spec, [2])
    op._reopen_mlflow_run(child, 2)  # what try 2 does before it trains
    clear_failure_on_success(later[2])
    runs = {r.data.tags.get(TAG_STAGE): r for r in hook.child_runs(parent)}
    assert _failure_tags(runs["a"]) == [] and runs["a"].info.status == "RUNNING"
    assert _failure_tags(hook.get_run(parent)) == []
    assert hook.get_run(parent).info.status == "RUNNING"  # close_run decides it


def test_close_run_takes_back_the_failure_of_a_task_marked_success(mlflow_server, monkeypatch):
    """Marked success by hand, a task runs no callback: the teardown clears what its failure
    left, and the run ends by the pipeline's outcome."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    raw = _raw()
    spec = PipelineSpec.model_validate(raw)
    hook = MlflowHook(tracking_uri=mlflow_server)
    validate = ValidateCheckpointOperator(task_id="validate_checkpoint", spec=raw,
                                          mlflow_tracking_uri=mlflow_server)
    run_id, ctx = _tries(validate, spec, [1])
    close_mlflow_run_on_failure(ctx[1])
    assert hook.get_run(run_id).info.status == "FAILED"
    close = CloseRunOperator(task_id="close_run", spec=raw, mlflow_tracking_uri=mlflow_server)
    failed = {**ALL_SUCCEEDED, "validate_checkpoint": "failed", "register_model": "upstream_failed"}
    assert close.close(spec, spec.dag_id, RUN, failed, {}).ended_runs == {}
    run = hook.get_run(run_id)  # still failed: its failure stays
    assert run.info.status == "FAILED" and _failure_tags(run) == ["trainforge.failed_task"]
    # validate_checkpoint marked success, register_model ran: the teardown runs again
    report = close.close(spec, spec.dag_id, RUN, ALL_SUCCEEDED, REGISTERED)
    assert report.ended_runs == {run_id: "FINISHED"} and report.problems == []
    run = hook.get_run(run_id)
    assert run.info.status == "FINISHED" and _failure_tags(run) == []
