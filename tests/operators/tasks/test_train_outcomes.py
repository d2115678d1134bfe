"""The ``train`` task's outcomes (operators/tasks/train.py) against a real MLflow server on loopback.

A failure after training (a rank stuck in a collective at exit, the final checkpoint complete)
gets its own reason and follows ``training.fault.post_training_failure``; every failed try is
recorded for the run summary; with side-by-side stages each stage tags, reopens and ends only its
own child run, and the DAG run's run is left to ``close_run``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from trainforge.callbacks import close_mlflow_run_on_failure
from trainforge.cli.runner_summary import collect_summary
from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.mlflow_runs import TAG_STAGE
from trainforge.pipeline import load_spec
from trainforge.pipeline.spec import PipelineSpec
from trainforge.tasks.train import TrainOperator, post_training_reason

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "tests" / "faults" / "fault_tiny.yaml"
HANDLE = {"engine": "local", "key": "fault_tiny-train-1"}
FINISHED_THEN_HUNG = {  # what rank 0 wrote before rank 1 failed at exit
    "status": "success", "exit_code": 0, "message": "finished at step 40", "final_step": 40,
    "tokens_seen": 5120, "final_train_loss": 3.1, "last_checkpoint": "/ck/step-00000040"}


def _raw(stages=None, **fault):
    raw = load_spec(SPEC).model_dump(mode="json")
    raw["pipeline"]["mlflow_experiment"] = f"train-outcomes-{time.time_ns()}"
    raw["training"]["fault"].update(fault)
    if stages:
        raw["stages"] = [{"name": name} for name in stages]
    return raw


class FakeTI:
    def __init__(self, task_id: str, try_number: int = 1, run_id: str = "manual__r1"):
        self.dag_id, self.run_id, self.task_id, self.try_number = "fault_tiny", run_id, task_id, try_number
        self.pushed = {}

    def xcom_pull(self, task_ids=None, key=None):
        return None

    def xcom_push(self, key, value):
        self.pushed[key] = value


def _task(raw, server, stage=None):
    task_id = f"train_{stage}" if stage else "train"
    op = TrainOperator(task_id=task_id, spec=raw, mlflow_tracking_uri=server, stage=stage)
    return op, {"ti": FakeTI(task_id), "params": {}, "task": op}


def _error(result, exit_code=1):
    return {"status": "error", "message": f"job {HANDLE['key']} failed (transient): {result['message']}",
            "handle": HANDLE, "job": {}, "exit_code": exit_code, "failure": "transient",
            "result": result, "wall_s": 12.0}


def _parent(server, raw):
    spec = PipelineSpec.model_validate(raw)
    hook = MlflowHook(tracking_uri=server)
    return hook, hook.get_or_create_run(spec.experiment_name, "fault_tiny", "manual__r1")


def test_a_failure_after_training_is_named_and_the_retry_resumes_by_default(mlflow_server):
    raw = _raw()
    op, context = _task(raw, mlflow_server)
    with pytest.raises(RuntimeError) as info:
        op.execute_complete(context, _error(FINISHED_THEN_HUNG, exit_code=1))
    message = str(info.value)
    assert "failed after training: a rank failed after training finished" in message
    assert "the final checkpoint at step 40 is complete (/ck/step-00000040)" in message
    assert "post_training_failure is 'resume': the retry resumes at step 40" in message
    assert "(transient): finished at step 40" not in message
    hook, parent = _parent(mlflow_server, raw)
    run = hook.get_run(parent)
    assert run.data.tags["trainforge.failed_try.train.1"].startswith(
        f"job {HANDLE['key']} failed after training")
    # what the failed try cost is in the run even if no retry succeeds
    assert {"goodput/wall_s", "gpu_hours/allocated", "energy/kwh", "disruptions/count"} <= set(
        run.data.metrics)
    assert run.data.tags["ledger/program_startup"].startswith("unknown: the trainer left no")
    assert run.data.tags["energy/source/cpu"] == "estimated"


def test_the_trainers_own_reason_is_kept():
    result = {**FINISHED_THEN_HUNG, "status": "error", "exit_code": 1, "phase": "after_training",
              "message": "post-training collective timeout on rank 1; the final checkpoint at step 40 "
                         "is complete (/ck/step-00000040)"}
    assert post_training_reason(_error(result)) == result["message"]
    assert post_training_reason(_error({**FINISHED_THEN_HUNG, "status": "error"})) is None


def test_post_training_failure_fail_is_permanent(mlflow_server):
    op, context = _task(_raw(post_training_failure="fail"), mlflow_server)
    with pytest.raises(AirflowFailException, match="post_training_failure is 'fail'"):
        op.execute_complete(context, _error(FINISHED_THEN_HUNG))


def test_post_training_failure_accept_succeeds_with_the_final_checkpoint(mlflow_server):
    raw = _raw(post_training_failure="accept")
    op, context = _task(raw, mlflow_server)
    out = op.execute_complete(context, _error(FINISHED_THEN_HUNG))
    assert out["last_checkpoint"] == "/ck/step-00000040" and out["final_step"] == 40
    hook, parent = _parent(mlflow_server, raw)
    assert hook.get_run(parent).data.tags["trainforge.failed_try.train.1"].startswith("accepted: ")


def test_side_by_side_stages_keep_to_their_own_runs_and_the_summary_counts_every_stage(
        mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # the failure callback's hook
    raw = _raw(stages=["a", "b"])
    hook, parent = _parent(mlflow_server, raw)
    op_a, ctx_a = _task(raw, mlflow_server, "a")
    op_b, ctx_b = _task(raw, mlflow_server, "b")
    spec_a, spec_b = op_a.resolved_spec(ctx_a), op_b.resolved_spec(ctx_b)
    op_a.job_attached(ctx_a, spec_a, {"engine": "local", "key": "job-a"})
    op_b.job_attached(ctx_b, spec_b, {"engine": "local", "key": "job-b"})
    # Stage a diverges at step 25 and fails for good; its failure callback runs.
    diverged = {"status": "diverged", "exit_code": 79, "message": "step 25: train loss nan",
                "final_step": 25, "tokens_seen": 3200, "final_train_loss": None, "last_checkpoint": None}
    with pytest.raises(AirflowFailException):
        op_a.execute_complete(ctx_a, {**_error(diverged, 79), "failure": "permanent"})
    close_mlflow_run_on_failure(ctx_a)
    # Stage b finishes.
    op_b.execute_complete(ctx_b, {"status": "success", "message": "job job-b finished", "handle":
                                  {"engine": "local", "key": "job-b"}, "job": {}, "wall_s": None,
                                  "result": {**FINISHED_THEN_HUNG, "final_step": 40}})
    runs = {run.data.tags.get(TAG_STAGE): run for run in hook.child_runs(parent)}
    assert runs["a"].info.status == "FAILED" and runs["a"].data.tags["trainforge.failed_task"] == "train_a"
    assert runs["b"].info.status == "FINISHED"
    assert runs["a"].data.tags["trainforge.train.job"] == "job-a"
    assert runs["b"].data.tags["trainforge.train.job"] == "job-b"
    run = hook.get_run(parent)
    assert run.info.status == "RUNNING"  # close_run decides it once every task is done
    assert "trainforge.train.job" not in run.data.tags
    assert run.data.tags["trainforge.train.train_a.job"] == "job-a"
    assert run.data.tags["trainforge.train.train_b.job"] == "job-b"
    assert run.data.tags["trainforge.failed_task.train_a"] == "failed"
    summary = collect_summary(PipelineSpec.model_validate(raw), mlflow_server,
                              {"run_id": "manual__r1", "state": "failed"},
                              {"prepare_data": {"state": "success", "seconds": 1.0},
                               "train_a": {"state": "failed", "seconds": 5.0},
                               "train_b": {"state": "success", "seconds": 9.0}})
    assert summary["training_stages"]["a"]["steps_trained"] == 25
    assert summary["training_stages"]["a"]["state"] == "failed"
    assert summary["training_stages"]["b"]["steps_trained"] == 40
    assert summary["steps_trained"] == 65
    assert [(t["task"], t["try"]) for t in summary["failed_tries"]] == [("train_a", 1)]
    assert "step 25: train loss nan" in summary["failed_tries"][0]["reason"]


def test_a_stage_retry_reopens_its_own_run_not_the_dag_runs(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    raw = _raw(stages=["a", "b"])
    hook, parent = _parent(mlflow_server, raw)
    hook.end_run(parent, "FAILED")  # as an earlier version's callback left it
    op, context = _task(raw, mlflow_server, "a")
    child = hook.get_or_create_child_run(parent, "a")
    hook.end_run(child, "KILLED")  # try 1 of stage a was killed
    context["ti"].try_number = 2
    context["ti"].xcom_pull = lambda task_ids=None, key=None: {"dataset_dir": str(tmp_path / "ds")}
    from trainforge.engines.base import JobIdentity

    job, _ = op.prepare_job(context, op.resolved_spec(context),
                            JobIdentity("fault_tiny", "manual__r1", "train_a", 2))
    assert job.env["MLFLOW_RUN_ID"] == child
    assert hook.get_run(child).info.status == "RUNNING"
    assert hook.get_run(child).data.tags["trainforge.train.reopened_by_try_2"] == "KILLED"
    assert hook.get_run(parent).info.status == "FAILED"  # not this stage's to reopen


def test_a_retry_that_raises_the_same_exception_at_the_same_line_is_not_retried_again(mlflow_server, tmp_path):
    """Try 1's job and try 2's job each have rank 1 raise the same ValueError at the same line
    (real rank records): try 1 is transient and its try record keeps the cause; try 2 reads it
    from MLflow and fails permanently, naming the try it repeats (trainforge.repeated_failure)."""
    from tests.operators.test_repeated_failure import _bad_token, _failed_job

    raw = _raw()
    jobs = [_failed_job(tmp_path / str(n), _bad_token) for n in (1, 2)]  # the engine's message and result
    causes = [{**_error(job["result"]), "message": job["message"]} for job in jobs]
    op, context = _task(raw, mlflow_server)
    with pytest.raises(RuntimeError, match="transient failure: retry resumes") as first:
        op.execute_complete(context, causes[0])
    assert "raised ValueError during step 5" in str(first.value)
    op, context = _task(raw, mlflow_server)
    context["ti"].try_number = 2
    with pytest.raises(AirflowFailException) as second:
        op.execute_complete(context, causes[1])
    assert "raised the same ValueError at " in str(second.value) and "as try 1" in str(second.value)
    assert "(permanent failure: not retried)" in str(second.value)
    hook, parent = _parent(mlflow_server, raw)
    tags = hook.get_run(parent).data.tags
    assert '"repeats":1' in tags["trainforge.ledger.try.2"] and '"origin"' in tags["trainforge.ledger.try.1"]
