"""The ``train`` task: render the job, submit it to the engine, defer until it ends.

While the job runs the worker slot is free: :class:`~operators.triggers.TrainingJobTrigger`
polls the engine in the triggerer and passes rank 0's log lines into this task's log. When the
trigger fires, :meth:`TrainingLaunchOperator.execute_complete` validates the event and either
returns the job's outputs (XCom) or fails the task — permanently (no retry) for a bad config or
a diverged run, otherwise as a retryable failure that resumes from the newest valid checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

from operators.backends.base import JobIdentity
from operators.base import TrainforgeStageOperator, fail_permanently
from operators.errors import TriggerEventError
from operators.paths import checkpoint_root, trainforge_home
from operators.triggers import EVENT_STATUSES, TrainingJobTrigger


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


class TrainingLaunchOperator(TrainforgeStageOperator):
    """Launch distributed training for the spec and wait for it (deferrable).

    XCom (return value): ``{"job": key, "engine", "checkpoint_dir", "last_checkpoint",
    "final_step", "tokens_seen", "final_train_loss", "mlflow_run_id"}``.
    """

    ui_color = "#fde9d9"

    def __init__(self, *, prepare_task_id: str = "prepare_data", **kwargs: Any):
        super().__init__(**kwargs)
        self.prepare_task_id = prepare_task_id
        self._handle: dict[str, Any] | None = None

    @staticmethod
    def _backend_kwargs(spec: Any) -> dict[str, Any]:
        from operators.backends import backend_kwargs

        return backend_kwargs(spec.training, runs_root=str(trainforge_home() / "runs"))

    def execute(self, context: Any) -> Any:
        from operators.backends import get_backend
        from operators.jobconfig import build_training_job

        spec = self.resolved_spec(context)
        ti = context["ti"]
        prepared = ti.xcom_pull(task_ids=self.prepare_task_id)
        if not prepared or "dataset_dir" not in prepared:
            fail_permanently(
                f"no dataset from task {self.prepare_task_id!r} (XCom was {prepared!r})"
            )
        mlflow_run_id = self.mlflow_run_id(context, spec)
        identity = JobIdentity(ti.dag_id, ti.run_id, ti.task_id, int(ti.try_number))
        ckpt_dir = checkpoint_root(spec.training.checkpoint.uri, ti.dag_id, ti.run_id)
        env = {"MLFLOW_RUN_ID": mlflow_run_id}
        tracking_uri = self.mlflow_hook.tracking_uri
        if tracking_uri:
            env["MLFLOW_TRACKING_URI"] = tracking_uri
        job = build_training_job(spec, prepared["dataset_dir"], ckpt_dir, identity, env)
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
        self.defer(
            trigger=TrainingJobTrigger(
                engine=spec.training.engine,
                backend_kwargs=self._backend_kwargs(spec),
                handle=handle,
                poll_interval_s=spec.training.fault.poll_interval,
                deadline_epoch_s=time.time() + spec.training.fault.run_timeout,
            ),
            method_name="execute_complete",
        )

    def _adoptable_job(self, backend, identity: JobIdentity) -> dict[str, Any] | None:
        """This try's job, or an earlier try's job that is still running or has succeeded.

        A failed or cancelled earlier job is not adopted: this try launches a new job, which
        resumes from the newest valid checkpoint of the shared checkpoint folder.
        """
        from operators.backends.base import JobState

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

    def execute_complete(self, context: Any, event: Any = None) -> dict[str, Any]:
        from operators.backends import get_backend

        event = validate_event(event)
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
            if event.get("wall_s") is not None:
                from operators.accounting import account

                usage = account(spec, event["wall_s"])
                final.update({f"accounting/{k}": v for k, v in usage.items()})
                self.log.info("Accounting: %.1f s wall, %.4f GPU-hours, %.4f CPU-core-hours, "
                              "%.4f %s, %.5f kWh", usage["wall_s"], usage["gpu_hours"],
                              usage["cpu_core_hours"], usage["cost"], spec.cost.currency,
                              usage["energy_kwh"])
            self.mlflow_hook.log_metrics(
                mlflow_run_id, {k: float(v) for k, v in final.items() if v is not None}
            )
            return {
                "job": handle["key"],
                "engine": spec.training.engine,
                "checkpoint_dir": checkpoint_root(
                    spec.training.checkpoint.uri, ti.dag_id, ti.run_id
                ),
                "last_checkpoint": result.get("last_checkpoint"),
                "final_step": result.get("final_step"),
                "tokens_seen": result.get("tokens_seen"),
                "final_train_loss": result.get("final_train_loss"),
                "mlflow_run_id": mlflow_run_id,
            }
        if status == "timeout":
            backend = get_backend(spec.training.engine, **self._backend_kwargs(spec))
            self.log.error("%s; cancelling the job", event["message"])
            backend.cancel(handle)
            fail_permanently(event["message"])
        if status == "cancelled":
            raise RuntimeError(event["message"])
        if event.get("failure") == "permanent":
            fail_permanently(f"{event['message']} (permanent failure: not retried)")
        raise RuntimeError(f"{event['message']} (transient failure: retry resumes from the "
                           f"newest valid checkpoint)")

    def on_kill(self) -> None:
        if self._handle is None:
            return
        from operators.backends import get_backend
        from operators.spec.model import PipelineSpec

        spec = PipelineSpec.model_validate(self.spec)
        if not spec.training.fault.cancel_on_kill:
            self.log.info("cancel_on_kill is false: leaving job %s running", self._handle["key"])
            return
        self.log.info("Task killed: cancelling job %s", self._handle["key"])
        get_backend(spec.training.engine, **self._backend_kwargs(spec)).cancel(self._handle)
