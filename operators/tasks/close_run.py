"""The ``close_run`` teardown task: what a failed, killed or stopped pipeline left open is closed.

Every pipeline ends with :class:`CloseRunOperator` as an Airflow *teardown* task, downstream of
every other task; it runs once every upstream task is done, whatever its state, and its outcome
never decides the DAG run's state. From the states of the DAG run's tasks it:

1. **Jobs.** cancels every still pending or running job of every try of each training task that
   did not succeed (kept, and logged, with ``training.fault.cancel_on_kill: false``);
2. **MLflow runs.** removes the failure tags of tasks that have since succeeded (a run only
   such a failure ended ``FAILED`` is ``RUNNING`` again), then ends every run of the DAG run
   still ``RUNNING`` (and its stage runs),
   ``KILLED`` when the pipeline was stopped, else ``FAILED`` (``FINISHED`` when every task
   succeeded and registration finished), tagged ``trainforge.closed_by=close_run``.

Running it twice changes nothing the second time. An engine or MLflow error on one item is
logged, the rest is still closed, and the task fails with :class:`CloseRunError` naming what it
could not handle. The whole rule: docs/faults.md, "The teardown: `close_run`".
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainforge.engines.descriptors import backend_kwargs, get_backend
from trainforge.engines.base import JobHandle, JobIdentity, JobState
from trainforge.base import TrainforgeStageOperator
from trainforge.callbacks import clear_failure, failure_tags
from trainforge.errors import TrainforgeError
from trainforge.graph import CLOSE_RUN_TASK_ID, REGISTER_MODEL_TASK_ID, task_graph
from trainforge.hooks.mlflow_runs import TAG_STAGE
from trainforge.paths import trainforge_home
from trainforge.pipeline.spec import PipelineSpec
from trainforge.pipeline.stages import stage_spec

TAG_CLOSED_BY = "trainforge.closed_by"
TAG_NOT_SUCCEEDED = "trainforge.close_run.tasks_not_succeeded"
TAG_CANCELLED_JOBS = "trainforge.close_run.cancelled_jobs"
TAG_KEPT_JOBS = "trainforge.close_run.kept_jobs"
# A try that adopted an earlier try's job launched none of its own, so the search for a task's
# jobs steps over this many tries without a job past the task's retries + 1 before it stops.
SCAN_PAST_TRIES = 3
MAX_TRIES_SCANNED = 100
# Seconds between the polite stop and the forced one, as the trigger's cancellation uses.
CANCEL_GRACE_S = 20.0


class CloseRunError(TrainforgeError):
    """The teardown could not check or close some of what the DAG run left open."""

    def __init__(self, dag_id: str, run_id: str, problems: list[str]) -> None:
        self.problems = problems
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"close_run could not finish for DAG run {dag_id}/{run_id}; still open "
                         f"or unknown:\n{listed}\nClear close_run to try again once the engine "
                         f"and the MLflow server answer.")


@dataclasses.dataclass
class TaskJobs:
    """What the teardown found for one training task: ``(try, key, state)`` per job, oldest try
    first, the state after any cancellation by the teardown."""

    task_id: str
    jobs: list[tuple[int, str, JobState]] = dataclasses.field(default_factory=list)
    cancelled: list[str] = dataclasses.field(default_factory=list)
    kept: list[str] = dataclasses.field(default_factory=list)

    @property
    def newest_state(self) -> JobState | None:
        return self.jobs[-1][2] if self.jobs else None


@dataclasses.dataclass
class CloseReport:
    """The teardown's outcome (its XCom): job keys per action and the runs it ended."""

    tasks_not_succeeded: list[str]
    cancelled_jobs: list[str] = dataclasses.field(default_factory=list)
    kept_jobs: list[str] = dataclasses.field(default_factory=list)
    ended_runs: dict[str, str] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)

    def as_xcom(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def task_jobs(backend, dag_id: str, run_id: str, task_id: str,
              expected_tries: int) -> list[tuple[int, JobHandle]]:
    """Every job of one task's tries, ``(try, handle)``, oldest first.

    Tries 1 to ``expected_tries`` (the task's retries + 1) are all looked at; past them (a
    cleared task has more tries) the search goes on until :data:`SCAN_PAST_TRIES` tries in a
    row have no job, at most to try :data:`MAX_TRIES_SCANNED`.

    Raises:
        BackendError: the engine cannot be reached (from ``backend.find``).
    """
    found: list[tuple[int, JobHandle]] = []
    misses = 0
    for try_number in range(1, MAX_TRIES_SCANNED + 1):
        handle = backend.find(JobIdentity(dag_id, run_id, task_id, try_number))
        if handle is not None:
            found.append((try_number, handle))
            misses = 0
        elif try_number > expected_tries:
            misses += 1
            if misses >= SCAN_PAST_TRIES:
                break
    return found


def run_end_status(*, all_succeeded: bool, finished: bool, job_states: list[JobState | None],
                   ) -> str:
    """The status a still-``RUNNING`` run ends with (module docstring, "MLflow runs").

    Args:
        all_succeeded: every task of the DAG run (or, for a stage run, the stage's task)
            succeeded.
        finished: registration finished (for a stage run: its task returned a final checkpoint).
        job_states: the newest job state of each training task the run covers (None: no job).
    """
    if all_succeeded:
        return "FINISHED" if finished else "FAILED"
    if JobState.FAILED in job_states:
        return "FAILED"
    return "KILLED" if JobState.CANCELLED in job_states else "FAILED"


class CloseRunOperator(TrainforgeStageOperator):
    """Teardown of a pipeline: cancel what failed training tasks left running, end every MLflow
    run of the DAG run that is still ``RUNNING`` (module docstring).

    The training tasks and their stages come from the spec's task graph
    (:func:`trainforge.graph.task_graph`); ``register_model``'s XCom says registration finished.

    XCom: ``{"tasks_not_succeeded", "cancelled_jobs", "kept_jobs", "ended_runs": {run id:
    status}, "problems"}``.

    Raises (from ``execute``):
        CloseRunError: an engine or the MLflow server failed on some item (all others were
            handled).
    """

    ui_color = "#eeeeee"

    def execute(self, context: Any) -> dict[str, Any]:
        ti = context["ti"]
        # The spec as written: trigger params touch only optimisation fields, and a bad one
        # must not stop the teardown.
        spec = PipelineSpec.model_validate(self.spec)
        self.link_mlflow_run(context, spec)
        states = self.task_states(ti)
        train_tasks = [node.task_id for node in task_graph(spec).train_nodes]
        results = {task_id: ti.xcom_pull(task_ids=task_id)
                   for task_id in [*train_tasks, REGISTER_MODEL_TASK_ID]
                   if states.get(task_id) == "success"}
        report = self.close(spec, ti.dag_id, ti.run_id, states, results)
        if report.problems:
            raise CloseRunError(ti.dag_id, ti.run_id, report.problems)
        return report.as_xcom()

    def task_states(self, ti: Any) -> dict[str, str]:
        """``{task_id: state}`` of the DAG run's other tasks (``"none"`` for no state yet),
        read through the Task SDK's execution API."""
        # The Task SDK's runtime, imported only inside a running task (never at parse time).
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        found = RuntimeTaskInstance.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id])
        states = (found or {}).get(ti.run_id) or {}
        return {task_id: str(getattr(state, "value", state) or "none")
                for task_id, state in states.items() if task_id != self.task_id}

    # -- the work -------------------------------------------------------------------------------
    def close(self, spec: Any, dag_id: str, run_id: str, states: dict[str, str],
              results: dict[str, Any]) -> CloseReport:
        """Cancel, then end runs, for DAG run ``(dag_id, run_id)`` whose task states are
        ``states``; ``results`` holds the XCom of the succeeded training and registration
        tasks. Never raises for an engine or MLflow failure: it lands in ``problems``."""
        not_succeeded = sorted(t for t, s in states.items() if s != "success")
        report = CloseReport(tasks_not_succeeded=not_succeeded)
        if not_succeeded:
            self.log.info("Tasks that did not succeed: %s",
                          ", ".join(f"{t} ({states[t]})" for t in not_succeeded))
        else:
            self.log.info("Every task of DAG run %s succeeded", run_id)
        jobs = {}
        for node in task_graph(spec).train_nodes:
            if states.get(node.task_id) == "success":
                continue
            jobs[node.task_id] = self._close_jobs(spec, node.stage, dag_id, run_id, node.task_id,
                                                  report)
        self._close_runs(spec, dag_id, run_id, states, results, jobs, report)
        if not (report.cancelled_jobs or report.kept_jobs or report.ended_runs
                or report.problems):
            self.log.info("Nothing was left open: no job to cancel, no MLflow run RUNNING")
        return report

    def _close_jobs(self, spec: Any, stage: str | None, dag_id: str, run_id: str, task_id: str,
                    report: CloseReport) -> TaskJobs:
        out = TaskJobs(task_id)
        try:
            training = stage_spec(spec, stage).training
            backend = get_backend(training.engine, **backend_kwargs(
                training, runs_root=str(trainforge_home() / "runs")))
            for try_number, handle in task_jobs(backend, dag_id, run_id, task_id,
                                                self._expected_tries(task_id)):
                state = backend.status(handle).state
                if not state.terminal:
                    if training.fault.cancel_on_kill:
                        self.log.warning("Task %s did not succeed and its try %d job %s is still "
                                         "%s: cancelling job %s", task_id, try_number,
                                         handle["key"], state.value, handle["key"])
                        state = backend.cancel(handle, CANCEL_GRACE_S).state
                        out.cancelled.append(handle["key"])
                    else:
                        self.log.warning("Task %s did not succeed; its try %d job %s is %s and "
                                         "is kept (training.fault.cancel_on_kill is false)",
                                         task_id, try_number, handle["key"], state.value)
                        out.kept.append(handle["key"])
                out.jobs.append((try_number, handle["key"], state))
        except Exception as err:  # noqa: BLE001 - reported, and the teardown goes on
            self.log.error("Could not check the jobs of task %s: %s", task_id, err, exc_info=True)
            report.problems.append(f"jobs of task {task_id}: {type(err).__name__}: {err}")
        if not out.jobs:
            self.log.info("Task %s left no job", task_id)
        report.cancelled_jobs += out.cancelled
        report.kept_jobs += out.kept
        return out

    def _expected_tries(self, task_id: str) -> int:
        try:
            return int(self.dag.get_task(task_id).retries) + 1
        except Exception:  # noqa: BLE001 - outside a DAG (tests): the pipeline default
            return int(self.retries or 0) + 1

    def _clear_superseded_failures(self, spec: Any, parent: str, states: dict[str, str],
                                   stage_tasks: dict[str | None, str]) -> None:
        """A task whose failure is recorded on the run but that has since succeeded (a later
        try, or marked success, which runs no callback): its failure tags go, and a run it
        ended FAILED is RUNNING again, to be ended below (trainforge.callbacks)."""
        tags = self.mlflow_hook.get_run(parent).data.tags
        stages = {task_id: stage for stage, task_id in stage_tasks.items()}
        for task_id, state in sorted(states.items()):
            if state != "success":
                continue
            staged = bool(spec.stages)
            if any(k in tags and (staged or tags[k] == task_id)
                   for k in failure_tags(task_id, staged)):
                clear_failure(self.mlflow_hook, parent, task_id, stages.get(task_id), staged)

    def _close_runs(self, spec: Any, dag_id: str, run_id: str, states: dict[str, str],
                    results: dict[str, Any], jobs: dict[str, TaskJobs],
                    report: CloseReport) -> None:
        stage_tasks = {node.stage: node.task_id for node in task_graph(spec).train_nodes}
        hook = self.mlflow_hook
        try:
            parent = hook.find_run(spec.experiment_name, dag_id, run_id)
            if parent is None:
                self.log.info("DAG run %s has no MLflow run in experiment %s", run_id,
                              spec.experiment_name)
                return
            self._clear_superseded_failures(spec, parent, states, stage_tasks)
            runs = [hook.get_run(parent), *hook.child_runs(parent)]
        except Exception as err:  # noqa: BLE001 - reported
            self.log.error("Could not read the MLflow runs of DAG run %s: %s", run_id, err,
                           exc_info=True)
            report.problems.append(f"MLflow runs of DAG run {run_id}: {type(err).__name__}: {err}")
            return
        all_succeeded = not report.tasks_not_succeeded
        for run in runs:
            if run.info.status != "RUNNING":
                continue
            stage = run.data.tags.get(TAG_STAGE) if run.info.run_id != parent else None
            if stage is not None:
                task_id = stage_tasks.get(stage)  # None: a stage the spec no longer has
                covered = [jobs.get(task_id)]
                succeeded = states.get(task_id) == "success"
                finished = bool((results.get(task_id) or {}).get("last_checkpoint"))
                what = f"stage {stage}'s MLflow run {run.info.run_id}"
            else:
                covered = list(jobs.values())
                succeeded = all_succeeded
                finished = bool((results.get(REGISTER_MODEL_TASK_ID) or {}).get("version"))
                what = f"MLflow run {run.info.run_id} of DAG run {run_id}"
            status = run_end_status(
                all_succeeded=succeeded, finished=finished,
                job_states=[j.newest_state if j is not None else None for j in covered])
            if succeeded:
                done = ("its task returned a final checkpoint" if stage else
                        "registration finished") if finished else (
                        "its task returned no final checkpoint" if stage else
                        "registration returned no model version")
                self.log.warning("%s is still RUNNING although %s succeeded; ending it %s (%s)",
                                 what, "its task" if stage else "every task", status, done)
            tags = {TAG_CLOSED_BY: CLOSE_RUN_TASK_ID,
                    TAG_NOT_SUCCEEDED: ", ".join(report.tasks_not_succeeded) or "none"}
            cancelled = [k for j in covered if j is not None for k in j.cancelled]
            kept = [k for j in covered if j is not None for k in j.kept]
            if cancelled:
                tags[TAG_CANCELLED_JOBS] = ", ".join(cancelled)
            if kept:
                tags[TAG_KEPT_JOBS] = ", ".join(kept)
            try:
                hook.set_tags(run.info.run_id, tags)
                hook.end_run(run.info.run_id, status)
            except Exception as err:  # noqa: BLE001 - reported
                self.log.error("Could not end %s: %s", what, err, exc_info=True)
                report.problems.append(f"{what}: {type(err).__name__}: {err}")
                continue
            report.ended_runs[run.info.run_id] = status
            self.log.info("Ended %s %s", what, status)
