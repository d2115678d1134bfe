"""The ``train`` task: render the job, submit it to the engine, defer until it ends.

While the job runs the worker slot is free: :class:`~trainforge.triggers.TrainingJobTrigger`
polls the engine in the triggerer and passes rank 0's log lines into this task's log. When the
trigger fires, :meth:`TrainOperator.execute_complete` validates the event and either
returns the job's outputs (XCom) or fails the task — permanently (no retry) for a bad config or
a diverged run, otherwise as a retryable failure that resumes from the newest valid checkpoint.

Deadlines across deferral: Airflow applies ``execution_timeout`` to each piece of work a worker
runs, not to the deferred wait. So the operator turns both limits into one absolute deadline
before it defers — the job's ``fault.run_timeout`` counted from the job's submission (an adopted
earlier job keeps its own clock) and the task's ``execution_timeout`` counted from the try's
first start — gives the trigger that deadline (minus one poll and a margin, so the trigger's own
``timeout`` event, which cancels the job, comes first) and passes only the time left as
``defer(timeout=...)``. When Airflow's trigger timeout fires anyway, :meth:`resume_execution`
cancels the task's live jobs before failing.

Waiting in the worker slot (``training.fault.deferrable: false``, like the ``deferrable`` option of
Airflow's provider operators): :meth:`TrainOperator.execute` does everything up to the
deferral, then runs the very same trigger coroutine in the task process to its first event
(:meth:`~trainforge.triggers.TrainingJobTrigger.wait_here`) and hands that event to
:meth:`execute_complete` — one code path for events, logs and deadlines. The task process is
alive during the wait, so Airflow's own ``execution_timeout`` (SIGALRM in the task process) and
signals reach it: a SIGTERM runs :meth:`on_kill` (Airflow's Task SDK handler) and then ends the
wait with :class:`TaskProcessTerminated`, so the task fails or is up for retry, never succeeds;
the job is cancelled once (not at all with ``fault.cancel_on_kill: false``) and the trigger's own
cancel-on-kill path stays quiet in the task process.
"""

from __future__ import annotations

import datetime as dt
import signal
import threading
import time
from typing import Any

from trainforge.backends.base import JobIdentity
from trainforge.base import TrainforgeStageOperator, fail_permanently
from trainforge.errors import TriggerEventError
from trainforge.paths import checkpoint_root, dataset_location, trainforge_home
from trainforge.triggers import EVENT_STATUSES, TrainingJobTrigger

# Seconds the trigger's own deadline comes before Airflow's trigger timeout (plus one poll), so
# that the trigger's ``timeout`` event — which cancels the job and says why — wins the race.
DEADLINE_MARGIN_S = 5.0


def wait_deadline(
    *,
    now_s: float,
    job_submitted_s: float | None,
    run_timeout_s: float,
    task_started_s: float | None,
    execution_timeout_s: float | None,
    poll_interval_s: float,
) -> tuple[float, str, float]:
    """The deferred wait's deadline: ``(trigger deadline epoch s, reason, defer timeout s)``.

    The job may run ``run_timeout_s`` from its submission (``job_submitted_s``; ``now_s`` when
    unknown); the task may run ``execution_timeout_s`` from its first start (``task_started_s``).
    The earlier limit wins and names the ``reason`` (``"run_timeout"`` or
    ``"execution_timeout"``). The defer timeout is the time left to that limit (at least 1 s);
    the trigger deadline comes ``poll_interval_s + DEADLINE_MARGIN_S`` earlier, but never
    before ``now_s``.
    """
    limit, reason = (job_submitted_s or now_s) + run_timeout_s, "run_timeout"
    if execution_timeout_s is not None:
        task_limit = (task_started_s or now_s) + execution_timeout_s
        if task_limit < limit:
            limit, reason = task_limit, "execution_timeout"
    left = max(1.0, limit - now_s)
    trigger_deadline = max(now_s, limit - poll_interval_s - DEADLINE_MARGIN_S)
    return trigger_deadline, reason, left


class TaskProcessTerminated(BaseException):
    """The task process got SIGTERM while it waited on its job in the worker slot.

    A ``BaseException``, like Airflow's ``AirflowTaskTimeout``: raised from a signal handler, it
    must pass through the event loop of the wait (asyncio logs and swallows an ``Exception``
    raised inside a callback). Airflow's task runner records it as a failure, retried when
    retries are left (a worker shutdown is transient); the retry resumes or adopts the job.
    """


def validate_event(event: Any) -> dict[str, Any]:
    """Check a trigger event's shape before acting on it.

    Raises:
        TriggerEventError: not a dict, or ``status`` outside :data:`EVENT_STATUSES`, or no message.
    """
    if not isinstance(event, dict):
        raise TriggerEventError(f"trigger event must be a dict (got {type(event).__name__})")
    status = event.get("status")
    if status not in EVENT_STATUSES:
        raise TriggerEventError(
            f"trigger event status {status!r} is not one of {', '.join(EVENT_STATUSES)}"
        )
    if not isinstance(event.get("message"), str) or not isinstance(event.get("handle"), dict):
        raise TriggerEventError(f"trigger event lacks a message or job handle: {event!r}")
    return event


class TrainOperator(TrainforgeStageOperator):
    """Launch distributed training for the spec and wait for it (deferrable).

    XCom (return value): ``{"job": key, "engine", "checkpoint_dir", "last_checkpoint",
    "final_step", "tokens_seen", "final_train_loss", "mlflow_run_id", "stage", "init"}``.

    Args:
        stage: the spec stage this task trains (``stages[].name``; docs/stages.md), or None for
            a spec without stages. A stage trains with its merged training section, writes its
            checkpoints to ``<run's checkpoint root>/<stage>/``, logs into a child MLflow run of
            the DAG run's run, and, with ``init_from``, starts from the weights of that stage's
            final checkpoint (its task's XCom ``last_checkpoint``; job config ``init``).
    """

    ui_color = "#fde9d9"

    def __init__(self, *, prepare_task_id: str = "prepare_data", stage: str | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.prepare_task_id = prepare_task_id
        self.stage = stage
        self._handle: dict[str, Any] | None = None
        self._mlflow_run_id: str | None = None
        self._killed = False  # on_kill ran: it acts once per task process
        self._cancelled_keys: set[str] = set()  # jobs this process cancelled, each once

    def resolved_spec(self, context: Any):
        """The run's spec (trigger params applied) as this task's stage sees it."""
        from trainforge.pipeline.stages import stage_spec

        return stage_spec(super().resolved_spec(context), self.stage)

    def _checkpoint_dir(self, spec: Any, ti: Any) -> str:
        from trainforge.pipeline.stages import stage_folder

        return stage_folder(checkpoint_root(spec.training.checkpoint.uri, ti.dag_id, ti.run_id),
                            self.stage)

    def _stage_init(self, spec: Any, ti: Any) -> dict[str, str] | None:
        """The job config's ``init`` block of a stage with ``init_from``, else None."""
        from trainforge.jobconfig import init_block
        from trainforge.pipeline.stages import stage_init_from

        checkpoint = self._init_checkpoint(spec, ti)
        if checkpoint is None:
            return None
        return init_block(checkpoint, f"stage:{stage_init_from(spec, self.stage)}")

    def _registered_init(self, spec: Any, prepared: dict[str, Any]) -> dict[str, str]:
        """The ``init`` block of ``model.init_from`` (trainforge.tasks.model_init); a version that
        cannot be used fails the task without retries."""
        from trainforge.tasks.model_init import InitSourceError, registered_init

        try:
            init = registered_init(self.mlflow_hook, spec.model.init_from, spec.training.engine,
                                   trainforge_home() / "models", prepared.get("tokenizer_source"))
        except InitSourceError as err:
            fail_permanently(str(err))
        self.log.info("Training starts from the weights of %s (%s)", init["source"],
                      init["checkpoint"])
        return init

    def _init_after_wait(self, spec: Any, ti: Any, init: dict[str, str] | None):
        """The ``init`` block the job was launched with, once the wait is over.

        ``airflow dags test`` resumes a deferred task with the event only, without the
        deferral's kwargs: then the block is rebuilt the way :meth:`execute` built it — a
        stage's from the upstream stage's XCom, ``model.init_from``'s by resolving the same
        registered version again (the same value unless the alias moved meanwhile, which the
        validator then reports as a config-digest mismatch rather than passing silently).
        """
        if init is not None:
            return init
        init = self._stage_init(spec, ti)
        if init is None and spec.model.init_from:
            prepared = ti.xcom_pull(task_ids=self.prepare_task_id) or {}
            init = self._registered_init(spec, prepared)
        return init

    def _init_checkpoint(self, spec: Any, ti: Any) -> str | None:
        """The final checkpoint of the stage this one starts from (``init_from``), or None."""
        from trainforge.pipeline.stages import stage_init_from, stage_task_id

        init_from = stage_init_from(spec, self.stage)
        if init_from is None:
            return None
        upstream = ti.xcom_pull(task_ids=stage_task_id(init_from)) or {}
        if not upstream.get("last_checkpoint"):
            fail_permanently(f"stage {self.stage!r} starts from stage {init_from!r}, whose task "
                             f"{stage_task_id(init_from)!r} left no last_checkpoint (XCom was "
                             f"{upstream!r})")
        return upstream["last_checkpoint"]

    def _stage_run_id(self, spec: Any, parent_run_id: str) -> str:
        """This stage's MLflow run: a child (``mlflow.parentRunId``) of the DAG run's run, found
        again by its tags on a retry. The DAG run's own run for a spec without stages."""
        if self.stage is None:
            return parent_run_id
        client = self.mlflow_hook.client
        parent = client.get_run(parent_run_id)
        tags = {"mlflow.parentRunId": parent_run_id, "trainforge.stage": self.stage,
                "trainforge.pipeline": spec.dag_id}
        found = client.search_runs(
            [parent.info.experiment_id], max_results=1,
            filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' and "
                          f"tags.`trainforge.stage` = '{self.stage}'")
        if found:
            return found[0].info.run_id
        return client.create_run(parent.info.experiment_id, tags=tags,
                                 run_name=self.stage).info.run_id

    @staticmethod
    def _backend_kwargs(spec: Any) -> dict[str, Any]:
        from trainforge.backends import backend_kwargs

        return backend_kwargs(spec.training, runs_root=str(trainforge_home() / "runs"))

    def execute(self, context: Any) -> Any:
        from trainforge.backends import get_backend
        from trainforge.jobconfig import build_training_job

        spec = self.resolved_spec(context)
        ti = context["ti"]
        prepared = ti.xcom_pull(task_ids=self.prepare_task_id)
        if not prepared or "dataset_dir" not in prepared:
            fail_permanently(
                f"no dataset from task {self.prepare_task_id!r} (XCom was {prepared!r})"
            )
        mlflow_run_id = self.mlflow_run_id(context, spec)
        self._mlflow_run_id = mlflow_run_id
        self._reopen_mlflow_run(mlflow_run_id, int(ti.try_number))
        identity = JobIdentity(ti.dag_id, ti.run_id, ti.task_id, int(ti.try_number))
        ckpt_dir = self._checkpoint_dir(spec, ti)
        init = self._stage_init(spec, ti)
        if init is None and spec.model.init_from:
            init = self._registered_init(spec, prepared)
        env = {"MLFLOW_RUN_ID": self._stage_run_id(spec, mlflow_run_id)}
        tracking_uri = self.mlflow_hook.tracking_uri
        if tracking_uri:
            env["MLFLOW_TRACKING_URI"] = tracking_uri
        if init is not None and self.stage:
            self.log.info("Stage %s starts from the weights of %s (%s)", self.stage,
                          init["checkpoint"], init["source"])
        s3_env, secret_env = self._s3_access(spec)
        env.update(s3_env)
        job = build_training_job(spec, dataset_location(prepared), ckpt_dir, identity, env,
                                 init=init, secret_env=secret_env,
                                 secret_env_source=f"Airflow connection {spec.storage.aws_conn_id}")
        backend = get_backend(spec.training.engine, **self._backend_kwargs(spec))
        handle = self._adoptable_job(backend, identity)
        if handle is not None:
            self.log.info("Re-attaching to existing job %s", handle["key"])
        else:
            handle = backend.submit(job)
            self.log.info("Launched %s job %s; its checkpoints go to %s", spec.training.engine,
                          handle["key"], ckpt_dir)
        self._handle = handle
        self.mlflow_hook.set_tags(
            mlflow_run_id,
            {"trainforge.train.job": handle["key"], "trainforge.train.engine": spec.training.engine},
        )
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
            backend_kwargs=self._backend_kwargs(spec),
            handle=handle,
            poll_interval_s=fault.poll_interval,
            deadline_epoch_s=deadline,
            deadline_reason=reason,
            cancel_on_kill=fault.cancel_on_kill,
        )
        if not fault.deferrable:
            event = self._wait_in_task_process(trigger)
            return self.execute_complete(context, event, first_start_epoch_s=started, init=init)
        self.defer(
            trigger=trigger,
            method_name="execute_complete",
            # A non-empty kwargs also keeps the try's start date when the task resumes.
            kwargs={"first_start_epoch_s": started, "init": init},  # init: for the XCom
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

    def _cancel_once(self, backend: Any, handle: dict[str, Any], grace_s: float | None = None
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

    def _s3_access(self, spec: Any) -> tuple[dict[str, str], dict[str, str]]:
        """(plain env, secret env) of the ranks for ``storage.aws_conn_id``: region and
        endpoint, and the connection's keys (trainforge.hooks.s3). Empty without a connection.
        A connection that cannot be read, or a connection with an engine that would have to
        write its keys into a manifest or script, fails the task without retries."""
        from trainforge.hooks.s3 import S3ConnectionError, S3Hook

        hook = S3Hook.for_spec(spec)
        if hook.aws_conn_id is None:
            return {}, {}
        if spec.training.engine not in ("local", "ray"):
            fail_permanently(f"storage.aws_conn_id {hook.aws_conn_id!r} cannot be used with the "
                             f"{spec.training.engine} engine (expected local or ray; give the "
                             f"cluster's ranks credentials of their own, see docs/storage.md)")
        try:
            return hook.plain_env(), hook.secret_env()
        except S3ConnectionError as err:
            fail_permanently(str(err))
            raise  # unreachable

    def _reopen_mlflow_run(self, run_id: str, try_number: int) -> None:
        """An earlier try that was killed (KILLED) or failed (FAILED) ended the DAG run's MLflow
        run; this try trains on, so the run is RUNNING again until the pipeline ends it."""
        client = self.mlflow_hook.client
        status = client.get_run(run_id).info.status
        if status in ("KILLED", "FAILED"):
            client.update_run(run_id, status="RUNNING")
            self.mlflow_hook.set_tags(run_id, {f"trainforge.train.reopened_by_try_{try_number}":
                                               status})
            self.log.info("MLflow run %s was %s after an earlier try: RUNNING again for try %d",
                          run_id, status, try_number)

    def _adoptable_job(self, backend, identity: JobIdentity) -> dict[str, Any] | None:
        """This try's job, or an earlier try's job that is still running or has succeeded.

        A failed or cancelled earlier job is not adopted: this try launches a new job, which
        resumes from the newest valid checkpoint of the shared checkpoint folder.
        """
        from trainforge.backends.base import JobState

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

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any):
        """Resume after the trigger; when Airflow failed the wait itself, cancel live jobs first.

        Airflow resumes with ``TaskDeferralTimeout`` when the deferral outlived its timeout
        and ``TaskDeferralError`` when the trigger crashed: the job must not outlive its task.
        """
        from airflow.sdk.exceptions import TaskDeferralError, TaskDeferralTimeout

        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except (TaskDeferralTimeout, TaskDeferralError) as err:
            self.log.error("The wait for the training job ended without an event (%s)", err)
            self._cancel_live_jobs(context)
            raise

    def _cancel_live_jobs(self, context: Any) -> None:
        """Cancel every non-terminal job of this task (this try's and earlier tries')."""
        from trainforge.backends import get_backend

        spec = self.resolved_spec(context)
        if not spec.training.fault.cancel_on_kill:
            self.log.info("cancel_on_kill is false: leaving this task's jobs running")
            return
        ti = context["ti"]
        backend = get_backend(spec.training.engine, **self._backend_kwargs(spec))
        for try_number in range(int(ti.try_number), 0, -1):
            handle = backend.find(JobIdentity(ti.dag_id, ti.run_id, ti.task_id, try_number))
            if handle is not None and not backend.status(handle).state.terminal:
                self.log.warning("Cancelling job %s", handle["key"])
                backend.cancel(handle)

    def execute_complete(
        self, context: Any, event: Any = None, first_start_epoch_s: float | None = None,
        init: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        from trainforge.backends import get_backend

        event = validate_event(event)
        self._handle = event["handle"]
        if first_start_epoch_s is not None:
            self.log.info("The wait ended %.0f s after this try first started",
                          time.time() - float(first_start_epoch_s))
        spec = self.resolved_spec(context)
        handle = event["handle"]
        status = event["status"]
        if status == "success":
            result = event.get("result") or {}
            ti = context["ti"]
            self.log.info("%s", event["message"])
            mlflow_run_id = self.mlflow_run_id(context, spec)
            final = {"train/final_step": result.get("final_step"),
                     "train/tokens_seen": result.get("tokens_seen"),
                     "train/final_loss": result.get("final_train_loss")}
            prefix = f"{self.stage}/" if self.stage else ""  # one series per stage
            if event.get("wall_s") is not None:
                from trainforge.accounting import account

                usage = account(spec, event["wall_s"])
                final.update({f"accounting/{prefix}{k}": v for k, v in usage.items()})
                self.log.info("Accounting: %.1f s wall, %.4f GPU-hours, %.4f CPU-core-hours, "
                              "%.4f %s, %.5f kWh", usage["wall_s"], usage["gpu_hours"],
                              usage["cpu_core_hours"], usage["cost"], spec.cost.currency,
                              usage["energy_kwh"])
            if self.stage:
                final = {k.replace("train/", f"train/{prefix}", 1): v for k, v in final.items()}
                self.mlflow_hook.end_run(self._stage_run_id(spec, mlflow_run_id), "FINISHED")
            self.mlflow_hook.log_metrics(
                mlflow_run_id, {k: float(v) for k, v in final.items() if v is not None}
            )
            return {
                "stage": self.stage,
                # The job config's init block: validation expects the same.
                "init": self._init_after_wait(spec, ti, init),
                "job": handle["key"],
                "engine": spec.training.engine,
                "checkpoint_dir": self._checkpoint_dir(spec, ti),
                "last_checkpoint": result.get("last_checkpoint"),
                "final_step": result.get("final_step"),
                "tokens_seen": result.get("tokens_seen"),
                "final_train_loss": result.get("final_train_loss"),
                "mlflow_run_id": mlflow_run_id,
            }
        if status == "timeout":
            backend = get_backend(spec.training.engine, **self._backend_kwargs(spec))
            self.log.error("%s; cancelling the job", event["message"])
            self._cancel_once(backend, handle)
            if event.get("deadline_reason") == "execution_timeout":
                from airflow.sdk.exceptions import AirflowTaskTimeout

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

    def on_kill(self) -> None:
        """SIGTERM to the task process (or its execution timeout): the job is cancelled and the
        MLflow run ends KILLED — unless ``fault.cancel_on_kill`` is false: then the job trains
        on and its run stays RUNNING. A retry reopens the run (:meth:`_reopen_mlflow_run`) and
        resumes the job's checkpoints. Acts once per task process (a second SIGTERM, or the
        task runner's call after a timeout event that already cancelled the job, does not
        cancel again)."""
        if self._killed:
            return
        self._killed = True
        if self._handle is None:
            self._end_mlflow_run_killed()
            return
        from trainforge.backends import get_backend
        from trainforge.pipeline.model import PipelineSpec

        from trainforge.pipeline.stages import stage_spec

        spec = stage_spec(PipelineSpec.model_validate(self.spec), self.stage)
        if not spec.training.fault.cancel_on_kill:
            self.log.info("cancel_on_kill is false: leaving job %s running", self._handle["key"])
            return
        key = self._handle["key"]
        try:
            if key in self._cancelled_keys:
                self.log.info("Task killed: job %s was already cancelled by this task", key)
            else:
                self.log.info("Task killed: cancelling job %s", key)
                self._cancel_once(get_backend(spec.training.engine,
                                              **self._backend_kwargs(spec)), self._handle)
        finally:
            self._end_mlflow_run_killed()

    def _end_mlflow_run_killed(self) -> None:
        if self._mlflow_run_id is None:
            return
        try:
            self.mlflow_hook.set_tags(self._mlflow_run_id, {"trainforge.killed_task": self.task_id})
            self.mlflow_hook.end_run(self._mlflow_run_id, "KILLED")
            self.log.info("MLflow run %s ended KILLED", self._mlflow_run_id)
        except Exception:  # noqa: BLE001 - never mask the kill itself
            self.log.warning("could not end the MLflow run KILLED", exc_info=True)
