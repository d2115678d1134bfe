"""Task callbacks: keep the MLflow run's state honest when a task fails for good.

A DAG run's MLflow run stays RUNNING while its tasks work; the last task ends it FINISHED. When a
task fails with no retry left, :func:`close_mlflow_run_on_failure` ends the run FAILED, so no
failed pipeline leaves a run RUNNING forever. It never raises: a callback must not hide the
task's own error.

With ``stages`` the DAG run's run is shared by stages that may run side by side, so a failed
stage ends only its own child run FAILED (the others train on and end theirs), a failed task
tags the DAG run's run ``trainforge.failed_task.<task_id>``, and that run's status is decided
once, at the end, by ``close_run``.

A callback runs only where Airflow runs it: a task marked failed from the UI, or a task process
killed with SIGKILL, ends without one. The ``close_run`` teardown
(operators/tasks/close_run.py) closes what those leave, stage runs included; it does not carry
this callback, so that its own failure never ends a finished run FAILED.
"""

from __future__ import annotations

import logging
from typing import Any

from trainforge.hooks.mlflow import TAG_STAGE, MlflowHook
from trainforge.pipeline.model import PipelineSpec

log = logging.getLogger(__name__)


def close_mlflow_run_on_failure(context: Any) -> None:
    """``on_failure_callback``: end the DAG run's MLflow run with status FAILED."""
    try:
        ti = context["ti"]
        spec = PipelineSpec.model_validate(context["task"].spec)
        hook = MlflowHook()
        run_id = hook.find_run(spec.experiment_name, ti.dag_id, ti.run_id)
        if run_id is None:
            return
        if spec.stages:
            _close_stage_run(hook, run_id, getattr(context["task"], "stage", None), ti.task_id)
            return
        hook.set_tags(run_id, {"trainforge.failed_task": ti.task_id})
        hook.end_run(run_id, "FAILED")
        log.info("Ended MLflow run %s as FAILED (task %s failed)", run_id, ti.task_id)
    except Exception:  # noqa: BLE001 - never mask the task's own failure
        log.warning("could not mark the MLflow run FAILED", exc_info=True)


def _close_stage_run(hook: MlflowHook, parent_run_id: str, stage: str | None, task_id: str) -> None:
    """A pipeline with stages: end the failed stage's own run FAILED; the DAG run's run only
    gets a tag (``close_run`` ends it once every task is done)."""
    hook.set_tags(parent_run_id, {f"trainforge.failed_task.{task_id}": "failed"})
    if stage is None:
        log.info("Task %s failed; MLflow run %s is ended by close_run", task_id, parent_run_id)
        return
    for run in hook.child_runs(parent_run_id):
        if run.data.tags.get(TAG_STAGE) == stage and run.info.status == "RUNNING":
            hook.set_tags(run.info.run_id, {"trainforge.failed_task": task_id})
            hook.end_run(run.info.run_id, "FAILED")
            log.info("Ended stage %s's MLflow run %s as FAILED (task %s failed); the DAG run's "
                     "run %s is ended by close_run", stage, run.info.run_id, task_id, parent_run_id)
