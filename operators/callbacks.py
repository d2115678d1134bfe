"""Task callbacks: keep the MLflow run's state honest when a task fails for good or recovers.

:func:`close_mlflow_run_on_failure` ends the DAG run's MLflow run FAILED when a task fails with
no retry left (with ``stages``: the stage's own run; the DAG run's run only gets a tag, and
``close_run`` decides it). :func:`clear_failure_on_success` takes back what an earlier try's
failure wrote once a later try of the same task succeeds. Neither ever raises: a callback must
not hide the task's own outcome.

Each acts once per (DAG run, task, try): what it acted on is a tag on the DAG run's run, and a
delivery for a try already handled, or older than the newest try that started (each try records
itself, trainforge.base), changes nothing. The rule: docs/faults.md, "Callbacks act once".
"""

from __future__ import annotations

import logging
from typing import Any

from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.mlflow_runs import TAG_STAGE
from trainforge.pipeline.spec import PipelineSpec

log = logging.getLogger(__name__)

TAG_FAILED_TASK = "trainforge.failed_task"
"""The task whose failure ended the run (with ``stages``: ``.<task_id>`` on the DAG run's run)."""
TAG_KILLED_TASK = "trainforge.killed_task"
TAG_TRY_STARTED = "trainforge.try_started"
"""``trainforge.try_started.<task_id>``: the newest try of the task that began."""
TAG_CALLBACK = "trainforge.callback"
"""``trainforge.callback.<task_id>.<try>``: ``failure`` or ``success``, what was acted on."""


def try_started_tag(task_id: str) -> str:
    return f"{TAG_TRY_STARTED}.{task_id}"


def callback_tag(task_id: str, try_number: int) -> str:
    return f"{TAG_CALLBACK}.{task_id}.{int(try_number)}"


def failure_tags(task_id: str, stage: bool) -> list[str]:
    """Tags of the DAG run's run that say ``task_id`` failed (each holds the task's id, or, with
    ``stage``, is scoped by it)."""
    return [f"{TAG_FAILED_TASK}.{task_id}"] if stage else [TAG_FAILED_TASK, TAG_KILLED_TASK]


def close_mlflow_run_on_failure(context: Any) -> None:
    """``on_failure_callback``: end the DAG run's MLflow run with status FAILED."""
    try:
        ti = context["ti"]
        spec = PipelineSpec.model_validate(context["task"].spec)
        hook = MlflowHook()
        run_id = hook.find_run(spec.experiment_name, ti.dag_id, ti.run_id)
        if run_id is None or not _first_delivery(hook, run_id, ti, "failure"):
            return
        if spec.stages:
            _close_stage_run(hook, run_id, getattr(context["task"], "stage", None), ti.task_id)
        else:
            hook.set_tags(run_id, {TAG_FAILED_TASK: ti.task_id})
            hook.end_run(run_id, "FAILED")
            log.info("Ended MLflow run %s as FAILED (task %s try %s failed)", run_id, ti.task_id,
                     ti.try_number)
        hook.set_tags(run_id, {callback_tag(ti.task_id, ti.try_number): "failure"})
    except Exception:  # noqa: BLE001 - never mask the task's own failure
        log.warning("could not mark the MLflow run FAILED", exc_info=True)


def clear_failure_on_success(context: Any) -> None:
    """``on_success_callback``: remove the failure tags an earlier try of this task left, and
    set a run that task's failure ended FAILED back to RUNNING (the pipeline ends it)."""
    try:
        ti = context["ti"]
        spec = PipelineSpec.model_validate(context["task"].spec)
        hook = MlflowHook()
        run_id = hook.find_run(spec.experiment_name, ti.dag_id, ti.run_id)
        if run_id is None or not _first_delivery(hook, run_id, ti, "success"):
            return
        clear_failure(hook, run_id, ti.task_id, getattr(context["task"], "stage", None),
                      bool(spec.stages))
        hook.set_tags(run_id, {callback_tag(ti.task_id, ti.try_number): "success"})
    except Exception:  # noqa: BLE001 - never fail a task that succeeded
        log.warning("could not clear the failure tags of the MLflow run", exc_info=True)


def clear_failure(hook: MlflowHook, run_id: str, task_id: str, stage: str | None,
                  staged: bool) -> list[str]:
    """Take back the failure of ``task_id`` recorded on DAG run's run ``run_id`` (and on the
    stage's own run); the tags removed. ``trainforge.failed_try.*`` stays: it is history.

    Raises:
        MlflowRequestError: the server failed a call.
    """
    run = hook.get_run(run_id)
    ours = [k for k in failure_tags(task_id, staged)
            if k in run.data.tags and (staged or run.data.tags[k] == task_id)]
    removed = [f"{run_id}:{k}" for k in ours]
    hook.delete_tags(run_id, ours)
    if not staged and TAG_FAILED_TASK in ours and run.info.status == "FAILED":
        hook.reopen_run(run_id)
        log.info("MLflow run %s was FAILED by task %s, which has now succeeded: RUNNING again",
                 run_id, task_id)
    for child in hook.child_runs(run_id) if staged and stage is not None else []:
        if child.data.tags.get(TAG_STAGE) != stage:
            continue
        own = [k for k in (TAG_FAILED_TASK, TAG_KILLED_TASK) if child.data.tags.get(k) == task_id]
        hook.delete_tags(child.info.run_id, own)
        removed += [f"{child.info.run_id}:{k}" for k in own]
    if removed:
        log.info("Task %s succeeded: removed the failure tags %s", task_id, ", ".join(removed))
    return removed


def _first_delivery(hook: MlflowHook, run_id: str, ti: Any, outcome: str) -> bool:
    """Whether this is the first delivery for (task, try) and no later try of the task began."""
    tags = hook.get_run(run_id).data.tags
    task_id, try_number = ti.task_id, int(ti.try_number)
    done = tags.get(callback_tag(task_id, try_number))
    if done is not None:
        log.info("The %s callback of task %s try %d was delivered again (%s already handled): "
                 "nothing to do", outcome, task_id, try_number, done)
        return False
    prefix = f"{TAG_CALLBACK}.{task_id}."
    later = [int(n) for key in tags if key.startswith(prefix)
             and (n := key[len(prefix):]).isdigit() and int(n) > try_number]
    newest = tags.get(try_started_tag(task_id), "")
    if newest.isdigit():
        later.append(int(newest))
    if max(later, default=0) > try_number:
        log.info("The %s callback of task %s try %d came after try %d began: nothing to do",
                 outcome, task_id, try_number, max(later))
        return False
    return True


def _close_stage_run(hook: MlflowHook, parent_run_id: str, stage: str | None, task_id: str) -> None:
    """A pipeline with stages: end the failed stage's own run FAILED; the DAG run's run only
    gets a tag (``close_run`` ends it once every task is done)."""
    hook.set_tags(parent_run_id, {f"{TAG_FAILED_TASK}.{task_id}": "failed"})
    if stage is None:
        log.info("Task %s failed; MLflow run %s is ended by close_run", task_id, parent_run_id)
        return
    for run in hook.child_runs(parent_run_id):
        if run.data.tags.get(TAG_STAGE) == stage and run.info.status == "RUNNING":
            hook.set_tags(run.info.run_id, {TAG_FAILED_TASK: task_id})
            hook.end_run(run.info.run_id, "FAILED")
            log.info("Ended stage %s's MLflow run %s as FAILED (task %s failed); the DAG run's "
                     "run %s is ended by close_run", stage, run.info.run_id, task_id, parent_run_id)
