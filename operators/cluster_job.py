"""A task that runs one job on a cluster engine: submit or adopt it, defer, complete, cancel.

:class:`ClusterJobOperator` holds what any such task needs; a task says only which job it
runs (:meth:`~ClusterJobOperator.prepare_job`) and what a finished job means
(:meth:`~ClusterJobOperator.job_succeeded`). ``train`` (trainforge.tasks.train) is one.

Submit or adopt: the job's identity is deterministic from (dag_id, run_id, task_id, try), so a
try first looks for its own job, then for an earlier try's job that is still running or has
succeeded, and re-attaches instead of launching a second copy.

While the job runs the worker slot is free: :class:`~trainforge.triggers.TrainingJobTrigger`
polls the engine in the triggerer and passes rank 0's log lines into this task's log. When the
trigger fires, :meth:`~ClusterJobOperator.execute_complete` validates the event and either
hands a success to the task or fails the task — permanently (no retry) for a bad config or a
diverged run, otherwise as a retryable failure that resumes from the newest valid checkpoint.

The deadlines across deferral and waiting in the worker slot (``training.fault.deferrable:
false``): see docs/faults.md, "The launch, inside"; the deadline and the event check are in
trainforge.cluster_wait.
"""

from __future__ import annotations

import abc
import datetime as dt
import signal
import threading
import time
from typing import Any

from airflow.sdk.exceptions import AirflowTaskTimeout, TaskDeferralError, TaskDeferralTimeout

from trainforge.engines.descriptors import backend_kwargs, get_backend, get_engine
from trainforge.engines.base import JobHandle, JobIdentity, JobState, TrainingJob
from trainforge.base import TrainforgeStageOperator, fail_permanently
from trainforge.cluster_wait import TaskProcessTerminated, validate_event, wait_deadline
from trainforge.errors import JobRefusedError
from trainforge.hooks.s3 import S3ConnectionError, S3Hook
from trainforge.paths import trainforge_home
from trainforge.pipeline.spec import PipelineSpec
from trainforge.triggers import TrainingJobTrigger

class ClusterJobOperator(TrainforgeStageOperator):
    """Run one job on the spec's engine and wait for it (deferrable); the module docstring.

    Subclasses implement :meth:`prepare_job` and :meth:`job_succeeded`, and may extend
    :meth:`job_attached` and :meth:`job_killed`. The engine and its settings are those of
    ``spec.training`` as :meth:`resolved_spec` (with the run's params) and :meth:`plain_spec`
    (without, where no context exists) return it.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._handle: JobHandle | None = None
        self._killed = False  # on_kill ran: it acts once per task process
        self._cancelled_keys: set[str] = set()  # jobs this process cancelled, each once

    # -- what a task adds (abstract: BaseOperator's metaclass is an ABCMeta) -------------------
    @abc.abstractmethod
    def prepare_job(self, context: Any, spec: PipelineSpec, identity: JobIdentity
                    ) -> tuple[TrainingJob, dict[str, Any]]:
        """The job this try runs, and the JSON-able keyword arguments that
        :meth:`job_succeeded` gets back with the event (they cross the deferral)."""

    @abc.abstractmethod
    def job_succeeded(self, context: Any, spec: PipelineSpec, event: dict[str, Any],
                      **job_kwargs: Any) -> Any:
        """The task's XCom once the trigger reported ``success``."""

    def job_attached(self, context: Any, spec: PipelineSpec, handle: JobHandle) -> None:
        """Called once the try has its job (launched or adopted), before the wait."""

    def job_killed(self) -> None:
        """Called from :meth:`on_kill` after the job was cancelled (or when there was none)."""

    def plain_spec(self) -> PipelineSpec:
        """The spec as written (no run params: :meth:`on_kill` has no context)."""
        return PipelineSpec.model_validate(self.spec)

    # -- the engine ---------------------------------------------------------------------------
    @staticmethod
    def backend_kwargs(spec: PipelineSpec) -> dict[str, Any]:
        """The engine's settings from ``spec.training``, as the backend and the trigger take."""
        return backend_kwargs(spec.training, runs_root=str(trainforge_home() / "runs"))

    def backend(self, spec: PipelineSpec) -> Any:
        return get_backend(spec.training.engine, **self.backend_kwargs(spec))

    def rank_s3_env(self, spec: PipelineSpec) -> tuple[dict[str, str], dict[str, str]]:
        """(plain env, secret env) of the ranks for ``storage.aws_conn_id``: region and
        endpoint, and the connection's keys (trainforge.hooks.s3). Empty without a connection.
        A connection that cannot be read, or a connection with an engine that would have to
        write its keys into a manifest or script, fails the task without retries."""
        hook = S3Hook.for_spec(spec)
        if hook.aws_conn_id is None:
            return {}, {}
        # Only an engine whose job request never holds the ranks' secrets (a process's
        # environment, Ray's runtime env over the job API) may get a connection's S3 keys.
        engine = get_engine(spec.training.engine)
        if not engine.secrets_in_memory:
            fail_permanently(f"storage.aws_conn_id {hook.aws_conn_id!r} cannot be used with the "
                             f"{engine.name} engine: its secrets would be written into the "
                             f"{engine.written_request} (expected null: {engine.secrets_remedy})")
        try:
            return hook.plain_env(), hook.secret_env()
        except S3ConnectionError as err:
            fail_permanently(str(err))
            raise  # unreachable

    # -- submit or adopt, then wait -----------------------------------------------------------
    def execute(self, context: Any) -> Any:
        spec = self.resolved_spec(context)
        ti = context["ti"]
        identity = JobIdentity(ti.dag_id, ti.run_id, ti.task_id, int(ti.try_number))
        job, job_kwargs = self.prepare_job(context, spec, identity)
        backend = self.backend(spec)
        handle = self._adoptable_job(backend, identity)
        if handle is not None:
            self.log.info("Re-attaching to existing job %s", handle["key"])
        else:
            try:
                handle = backend.submit(job)
            except JobRefusedError as err:
                fail_permanently(str(err))
            self.log.info("Launched %s job %s", spec.training.engine, handle["key"])
        self._handle = handle
        self.job_attached(context, spec, handle)
        return self._wait(context, spec, handle, job_kwargs)

    def _wait(self, context: Any, spec: PipelineSpec, handle: JobHandle,
              job_kwargs: dict[str, Any]) -> Any:
        """Defer until the job ends (or wait here with ``fault.deferrable: false``)."""
        ti = context["ti"]
        fault = spec.training.fault
        now = time.time()
        started = ti.start_date.timestamp() if getattr(ti, "start_date", None) else now
        deadline, reason, left_s = wait_deadline(
            now_s=now,
            job_submitted_s=handle.get("submitted_at_epoch_s"),
            run_timeout_s=fault.run_timeout,
            task_started_s=started,
            execution_timeout_s=(
                self.execution_timeout.total_seconds() if self.execution_timeout else None
            ),
            poll_interval_s=fault.poll_interval,
        )
        self.log.info("Waiting for job %s %s: %.0f s left (%s); the job is cancelled at its "
                      "deadline", handle["key"], "in the triggerer" if fault.deferrable else
                      "in this task process (fault.deferrable is false)", left_s, reason)
        trigger = TrainingJobTrigger(
            engine=spec.training.engine,
            backend_kwargs=self.backend_kwargs(spec),
            handle=handle,
            poll_interval_s=fault.poll_interval,
            deadline_epoch_s=deadline,
            deadline_reason=reason,
            cancel_on_kill=fault.cancel_on_kill,
        )
        if not fault.deferrable:
            event = self._wait_in_task_process(trigger)
            return self.execute_complete(context, event, first_start_epoch_s=started,
                                         **job_kwargs)
        self.defer(
            trigger=trigger,
            method_name="execute_complete",
            # A non-empty kwargs also keeps the try's start date when the task resumes.
            kwargs={"first_start_epoch_s": started, **job_kwargs},
            timeout=dt.timedelta(seconds=left_s),
        )

    def _wait_in_task_process(self, trigger: TrainingJobTrigger) -> dict[str, Any]:
        """Run ``trigger`` here until its first event (``fault.deferrable: false``); its payload.

        While it waits, SIGTERM (a worker shutdown, or Airflow's supervisor when the task was
        marked failed or success) runs :meth:`on_kill`, then the handler installed before
        (Airflow's Task SDK handler, whose own ``on_kill`` call is then a no-op), and ends the
        wait.

        Raises:
            TaskProcessTerminated: SIGTERM arrived during the wait.
            AirflowTaskTimeout: Airflow's ``execution_timeout`` expired during the wait (the
                task runner then calls :meth:`on_kill`).
        """
        if threading.current_thread() is not threading.main_thread():
            return trigger.wait_here()  # signals reach the main thread only
        previous = signal.getsignal(signal.SIGTERM)
        key = trigger.handle.get("key")

        def on_sigterm(signum: int, frame: Any) -> None:
            if self._killed:
                return  # a second SIGTERM must not interrupt the first one's cancel
            try:
                self.on_kill()
            except Exception:  # noqa: BLE001 - the wait must end all the same
                self.log.exception("on_kill failed for job %s", key)
            if callable(previous):
                previous(signum, frame)  # Airflow's handler: on_kill again, a no-op now
            raise TaskProcessTerminated(
                f"the task process got SIGTERM while it waited on job {key}; "
                + ("the job was cancelled" if key in self._cancelled_keys else
                   "the job was not cancelled (see the lines above)"))

        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            return trigger.wait_here()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _adoptable_job(self, backend: Any, identity: JobIdentity) -> JobHandle | None:
        """This try's job, or an earlier try's job that is still running or has succeeded.

        A failed or cancelled earlier job is not adopted: this try launches a new job, which
        resumes from the newest valid checkpoint of the shared checkpoint folder.
        """
        mine = backend.find(identity)
        if mine is not None:
            return mine
        for earlier in range(identity.try_number - 1, 0, -1):
            previous = JobIdentity(identity.dag_id, identity.run_id, identity.task_id, earlier)
            handle = backend.find(previous)
            if handle is None:
                continue
            state = backend.status(handle).state
            if state in (JobState.RUNNING, JobState.PENDING, JobState.SUCCEEDED):
                self.log.info("Try %s's job %s is %s: adopting it instead of launching another",
                              earlier, handle["key"], state.value)
                return handle
            self.log.info("Try %s's job %s ended %s: launching a new job that resumes",
                          earlier, handle["key"], state.value)
            return None
        return None

    # -- the end of the wait ------------------------------------------------------------------
    def execute_complete(self, context: Any, event: Any = None,
                         first_start_epoch_s: float | None = None, **job_kwargs: Any) -> Any:
        """Act on the trigger's event: :meth:`job_succeeded` on ``success``; a timeout cancels
        the job; a cancelled adopted job launches a new one; a failure fails the task,
        permanently when the job's failure is."""
        event = validate_event(event)
        self._handle = event["handle"]
        if first_start_epoch_s is not None:
            self.log.info("The wait ended %.0f s after this try first started",
                          time.time() - float(first_start_epoch_s))
        spec = self.resolved_spec(context)
        status = event["status"]
        if status == "success":
            self.log.info("%s", event["message"])
            return self.job_succeeded(context, spec, event, **job_kwargs)
        if status == "timeout":
            self.log.error("%s; cancelling the job", event["message"])
            self._cancel_once(self.backend(spec), event["handle"])
            if event.get("deadline_reason") == "execution_timeout":
                # Like any task timeout: retried when retries are left, resuming the checkpoints.
                raise AirflowTaskTimeout(event["message"])
            fail_permanently(event["message"])
        if status == "cancelled":
            adopted_try = int((event.get("job") or {}).get("try_number") or 0)
            if 0 < adopted_try < int(context["ti"].try_number):
                # This try adopted an earlier try's job that was being cancelled (the task was
                # cleared while deferred); it is gone now, so this try launches its own job,
                # which resumes from the newest valid checkpoint.
                self.log.warning("%s (it belonged to try %d); launching a new job",
                                 event["message"], adopted_try)
                return self.execute(context)
            raise RuntimeError(event["message"])
        if event.get("failure") == "permanent":
            fail_permanently(f"{event['message']} (permanent failure: not retried)")
        raise RuntimeError(f"{event['message']} (transient failure: retry resumes from the "
                           f"newest valid checkpoint)")

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any):
        """Resume after the trigger; when Airflow failed the wait itself, cancel live jobs first.

        Airflow resumes with ``TaskDeferralTimeout`` when the deferral outlived its timeout
        and ``TaskDeferralError`` when the trigger crashed: the job must not outlive its task.
        """
        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except (TaskDeferralTimeout, TaskDeferralError) as err:
            self.log.error("The wait for the job ended without an event (%s)", err)
            self._cancel_live_jobs(context)
            raise

    # -- cancelling ---------------------------------------------------------------------------
    def _cancel_live_jobs(self, context: Any) -> None:
        """Cancel every non-terminal job of this task (this try's and earlier tries')."""
        spec = self.resolved_spec(context)
        if not spec.training.fault.cancel_on_kill:
            self.log.info("cancel_on_kill is false: leaving this task's jobs running")
            return
        ti = context["ti"]
        backend = self.backend(spec)
        for try_number in range(int(ti.try_number), 0, -1):
            handle = backend.find(JobIdentity(ti.dag_id, ti.run_id, ti.task_id, try_number))
            if handle is not None and not backend.status(handle).state.terminal:
                self.log.warning("Cancelling job %s", handle["key"])
                backend.cancel(handle)

    def _cancel_once(self, backend: Any, handle: JobHandle, grace_s: float | None = None
                     ) -> None:
        """Cancel ``handle``'s job unless this process already did (a timeout event and the
        task runner's ``on_kill`` after it must not cancel twice)."""
        if handle["key"] in self._cancelled_keys:
            self.log.info("Job %s was already cancelled by this task", handle["key"])
            return
        if grace_s is None:
            backend.cancel(handle)
        else:
            backend.cancel(handle, grace_s)
        self._cancelled_keys.add(handle["key"])

    def on_kill(self) -> None:
        """SIGTERM to the task process (or its execution timeout): the job is cancelled, then
        :meth:`job_killed` — unless ``fault.cancel_on_kill`` is false: then the job runs on
        and nothing else happens. Acts once per task process (a second SIGTERM, or the task
        runner's call after a timeout event that already cancelled the job, does not cancel
        again)."""
        if self._killed:
            return
        self._killed = True
        if self._handle is None:
            self.job_killed()
            return
        spec = self.plain_spec()
        if not spec.training.fault.cancel_on_kill:
            self.log.info("cancel_on_kill is false: leaving job %s running", self._handle["key"])
            return
        key = self._handle["key"]
        try:
            if key in self._cancelled_keys:
                self.log.info("Task killed: job %s was already cancelled by this task", key)
            else:
                self.log.info("Task killed: cancelling job %s", key)
                self._cancel_once(self.backend(spec), self._handle)
        finally:
            self.job_killed()
