"""The ``train`` task: render the training job, run it on the engine, record what it trained.

The submit / adopt / defer / complete / cancel machinery is
:class:`~trainforge.cluster_job.ClusterJobOperator`'s (deadlines across deferral, waiting in the
worker slot, cancel on kill: docs/faults.md, "The launch, inside"). This task adds:

* the job: the spec's (or the stage's) training section rendered into a job config, with the
  dataset of ``prepare_data``, the DAG run's checkpoint folder, the MLflow run to log into, the
  ranks' S3 access, the ``init`` block of ``init_from`` (a stage's upstream checkpoint, or
  a registered model version through trainforge.init_from), and the ``pretrained``
  block of ``model.pretrained`` (prepare_data's resolution, trainforge.model_source);
* the MLflow run: reopened when an earlier try ended it, tagged with the job, ended ``KILLED``
  when the task is killed; a stage keeps to its own child run of the DAG run's run
  (docs/faults.md, "Side-by-side stages keep to their own runs");
* every failed try: why, as the tag ``trainforge.failed_try.<task_id>.<try>`` on the DAG run's
  run (the run summary lists them), and the step and tokens it reached as the stage's
  ``train/<stage>/final_step`` and ``train/<stage>/tokens_seen``;
* a job that failed after its training finished: its own reason instead of the trainer's
  "finished at step N" (``training.fault.post_training_failure``); a GPU out of memory:
  ``training.fault.on_oom`` (docs/faults.md, "Training (cluster side)");
* on success: the final step, tokens and loss, and the accounting over the ledger's window, as
  metrics and XCom; and at every outcome the ledger over every try so far — goodput, badput
  buckets, GPU-hours, energy, cost (trainforge.ledger; logged by trainforge.train_ledger,
  each try's start recorded when it has its job). The price is chosen before the job is launched: a
  spec naming no catalog row fails the task without retries.
"""

from __future__ import annotations

from typing import Any

from trainforge.accounting import account
from trainforge.engines.base import JobHandle, JobIdentity, TrainingJob
from trainforge.base import fail_permanently
from trainforge.cluster_job import ClusterJobOperator
from trainforge.hooks.mlflow import TAG_FAILED_TRY
from trainforge.jobconfig import build_training_job, init_block
from trainforge.ledger.build import Ledger
from trainforge.ledger.catalog import CatalogError, Price, choose_price
from trainforge.model_source import PretrainedSourceError, pretrained_section
from trainforge.paths import checkpoint_root, dataset_location, trainforge_home
from trainforge.pipeline.spec import PipelineSpec
from trainforge.pipeline.stages import stage_folder, stage_init_from, stage_spec, stage_task_id
from trainforge.storage.s3 import make_client
from trainforge.init_from import InitSourceError, registered_init
from trainforge.tasks.prepare_data import connection_s3_client
from trainforge.train_ledger import (ledger_dir, ledger_env, record_ledger,
                                           record_try_started, task_records)
from trainforge.oom_retry import oom_policy, retry_section
from trainforge.repeated_failure import repeated

MAX_TAG_CHARS = 5000  # MLflow's tag value limit is 8000 characters


def post_training_reason(event: dict[str, Any]) -> str | None:
    """Why a failed job failed after its training had finished, or None when it failed earlier.

    The trainer's result says so (``phase: after_training``, when rank 0 saw a rank miss the
    final barrier), or contradicts the job's failure (``status: success``: rank 0 finished and
    left, another rank failed later). Either way the final checkpoint was complete before.
    """
    result = event.get("result") or {}
    if result.get("phase") == "after_training" and result.get("message"):
        return str(result["message"])
    if result.get("status") == "success":
        checkpoint = result.get("last_checkpoint")
        return (f"a rank failed after training finished (job exit code {event.get('exit_code')}; "
                f"rank 0 reported {result.get('message')!r}); the final checkpoint at step "
                f"{result.get('final_step')} is complete"
                + (f" ({checkpoint})" if checkpoint else ""))
    return None


def apply_post_training_policy(event: dict[str, Any], reason: str, policy: str) -> dict[str, Any]:
    """The event as ``training.fault.post_training_failure`` (``policy``) has the task see it:
    ``accept`` a success, ``fail`` a permanent failure, ``resume`` a transient one."""
    key = (event.get("handle") or {}).get("key")
    step = (event.get("result") or {}).get("final_step")
    said = f"training.fault.post_training_failure is {policy!r}"
    if policy == "accept":
        return {**event, "status": "success",
                "message": f"job {key} failed after training: {reason}; {said}: the task "
                           f"succeeds with it"}
    if policy == "fail":
        return {**event, "failure": "permanent",
                "message": f"job {key} failed after training: {reason}; {said}"}
    return {**event, "failure": "transient",
            "message": f"job {key} failed after training: {reason}; {said}: the retry resumes at "
                       f"step {step} and finishes"}


class TrainOperator(ClusterJobOperator):
    """Launch distributed training for the spec and wait for it (deferrable).

    XCom (return value): ``{"job": key, "engine", "checkpoint_dir", "last_checkpoint",
    "final_step", "tokens_seen", "final_train_loss", "mlflow_run_id", "stage", "init",
    "pretrained"}``.

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
        self._mlflow_run_id: str | None = None
        self._first_start_s: float | None = None

    # -- the stage and its init ---------------------------------------------------------------
    def resolved_spec(self, context: Any) -> PipelineSpec:
        """The run's spec (trigger params applied) as this task's stage sees it."""
        return stage_spec(super().resolved_spec(context), self.stage)

    def plain_spec(self) -> PipelineSpec:
        """The spec as written, as this task's stage sees it."""
        return stage_spec(super().plain_spec(), self.stage)

    def _checkpoint_dir(self, spec: Any, ti: Any) -> str:
        return stage_folder(checkpoint_root(spec.training.checkpoint.uri, ti.dag_id, ti.run_id),
                            self.stage)

    def _stage_init(self, spec: Any, ti: Any) -> dict[str, str] | None:
        """The job config's ``init`` block of a stage with ``init_from``, else None."""
        checkpoint = self._init_checkpoint(spec, ti)
        if checkpoint is None:
            return None
        return init_block(checkpoint, f"stage:{stage_init_from(spec, self.stage)}")

    def _registered_init(self, spec: Any, prepared: dict[str, Any]) -> dict[str, str]:
        """The ``init`` block of ``model.init_from`` (trainforge.init_from); a version that
        cannot be used fails the task without retries."""
        try:
            init = registered_init(self.mlflow_hook, spec.model.init_from, spec.training.engine,
                                   trainforge_home() / "models", prepared.get("tokenizer_source"))
        except InitSourceError as err:
            fail_permanently(str(err))
        self.log.info("Training starts from the weights of %s (%s)", init["source"],
                      init["checkpoint"])
        return init

    def _pretrained(self, spec: Any, prepared: dict[str, Any] | None,
                    announce: bool = True) -> dict[str, Any] | None:
        """The job config's ``pretrained`` block: prepare_data's (XCom ``pretrained``), else
        resolved here; a source that cannot be used fails the task without retries."""
        uri = spec.model.pretrained
        if uri is None:
            return None
        s3 = ((connection_s3_client(spec) or make_client(spec.s3_endpoint_url))
              if uri.startswith("s3://") else None)  # the spec's endpoint, as the data step's
        try:
            section = pretrained_section(uri, prepared, engine=spec.training.engine,
                                         home=trainforge_home(), mlflow_hook=self.mlflow_hook,
                                         s3_client=s3)
        except PretrainedSourceError as err:
            fail_permanently(str(err))
        if announce:
            self.log.info("Training starts from the pretrained model %s (%s, revision %s)", uri,
                          section["folder"], section["revision"])
        return section

    def _init_after_wait(self, spec: Any, ti: Any, init: dict[str, str] | None):
        """The ``init`` block the job was launched with, once the wait is over.

        ``airflow dags test`` resumes a deferred task with the event only, without the
        deferral's kwargs: then the block is rebuilt the way :meth:`prepare_job` built it — a
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
        """This stage's MLflow run: a child of the DAG run's run, found again on a retry
        (:meth:`~trainforge.hooks.mlflow.MlflowHook.get_or_create_child_run`). The DAG run's own
        run for a spec without stages."""
        if self.stage is None:
            return parent_run_id
        return self.mlflow_hook.get_or_create_child_run(
            parent_run_id, self.stage, {"trainforge.pipeline": spec.dag_id})

    # -- the job ------------------------------------------------------------------------------
    def prepare_job(self, context: Any, spec: PipelineSpec, identity: JobIdentity
                    ) -> tuple[TrainingJob, dict[str, Any]]:
        """The training job of this try; ``init`` crosses the deferral for the XCom."""
        ti = context["ti"]
        self._price(spec)  # a price the spec cannot have fails before any training
        prepared = ti.xcom_pull(task_ids=self.prepare_task_id)
        if not prepared or "dataset_dir" not in prepared:
            fail_permanently(
                f"no dataset from task {self.prepare_task_id!r} (XCom was {prepared!r})"
            )
        mlflow_run_id = self.mlflow_run_id(context, spec)
        self._mlflow_run_id = self._stage_run_id(spec, mlflow_run_id)  # this task's own run
        self._reopen_mlflow_run(self._mlflow_run_id, identity.try_number)
        init = self._stage_init(spec, ti)
        if init is None and spec.model.init_from:
            init = self._registered_init(spec, prepared)
        pretrained = self._pretrained(spec, prepared)
        env = {"MLFLOW_RUN_ID": self._mlflow_run_id,
               **ledger_env(self._checkpoint_dir(spec, ti))}  # every try's attempt records
        tracking_uri = self.mlflow_hook.tracking_uri
        if tracking_uri:
            env["MLFLOW_TRACKING_URI"] = tracking_uri
        if init is not None and self.stage:
            self.log.info("Stage %s starts from the weights of %s (%s)", self.stage,
                          init["checkpoint"], init["source"])
        s3_env, secret_env = self.rank_s3_env(spec)
        env.update(s3_env)
        job = build_training_job(spec, dataset_location(prepared), self._checkpoint_dir(spec, ti),
                                 identity, env, init=init, secret_env=secret_env,
                                 secret_env_source=f"Airflow connection {spec.storage.aws_conn_id}",
                                 pretrained=pretrained, retry=retry_section(  # a smaller micro-batch after an OOM
                                     lambda: self.mlflow_hook.get_run(self._mlflow_run_id).data.tags,
                                     identity.try_number, spec.training, self.log))
        return job, {"init": init, "pretrained": pretrained}

    def job_attached(self, context: Any, spec: PipelineSpec, handle: JobHandle) -> None:
        self.log.info("Job %s writes its checkpoints to %s", handle["key"],
                      self._checkpoint_dir(spec, context["ti"]))
        tags = {"trainforge.train.job": handle["key"],
                "trainforge.train.engine": spec.training.engine}
        parent = self.mlflow_run_id(context, spec)
        own = self._mlflow_run_id or self._stage_run_id(spec, parent)
        self.mlflow_hook.set_tags(own, tags)
        if own != parent:  # the shared run: one key per stage task, never overwritten by another
            self.mlflow_hook.set_tags(parent,
                                      {f"trainforge.train.{self.task_id}.job": handle["key"]})
        ti = context["ti"]
        started = ti.start_date.timestamp() if getattr(ti, "start_date", None) else None
        try:  # the ledger's window opens at the first try's start (trainforge.ledger.tries)
            record_try_started(self.mlflow_hook, own, int(ti.try_number), started, dict(handle))
        except Exception:  # noqa: BLE001 - the ledger is worth less than the training
            self.log.warning("could not record this try's start for the ledger", exc_info=True)

    def _reopen_mlflow_run(self, run_id: str, try_number: int) -> None:
        """An earlier try that was killed (KILLED) or failed (FAILED) ended this task's MLflow
        run (a stage's: its child run; never the DAG run's run, which other stages share); this
        try trains on, so the run is RUNNING again until the pipeline ends it."""
        status = self.mlflow_hook.reopen_run(run_id)
        if status is not None:
            self.mlflow_hook.set_tags(run_id, {f"trainforge.train.reopened_by_try_{try_number}":
                                               status})
            self.log.info("MLflow run %s was %s after an earlier try: RUNNING again for try %d",
                          run_id, status, try_number)

    # -- the outcome --------------------------------------------------------------------------
    def execute_complete(self, context: Any, event: Any = None,
                         first_start_epoch_s: float | None = None, **job_kwargs: Any) -> Any:
        """A failed try is recorded, and a failure after training is named and follows
        ``training.fault.post_training_failure``; then the cluster-job handling."""
        self._first_start_s = first_start_epoch_s
        if (isinstance(event, dict) and event.get("status") in ("error", "timeout")
                and isinstance(event.get("handle"), dict)):
            spec = self.resolved_spec(context)
            reason = post_training_reason(event) if event["status"] == "error" else None
            if reason is not None:
                event = apply_post_training_policy(event, reason,
                                                   spec.training.fault.post_training_failure)
            event = oom_policy(event, spec.training.fault.on_oom)  # fail, or retry at a smaller micro-batch
            if event["status"] == "error":  # the same exception at the same line as the try before: permanent
                event = repeated(event, lambda: self.mlflow_hook.get_run(self._stage_run_id(
                    spec, self.mlflow_run_id(context, spec))).data.tags, int(context["ti"].try_number), self.log)
            self._record_failed_try(context, spec, event)
        return super().execute_complete(context, event, first_start_epoch_s, **job_kwargs)

    def _record_failed_try(self, context: Any, spec: PipelineSpec, event: dict[str, Any]) -> None:
        """Why this try failed (tag on the DAG run's run), how far it got (the stage's metrics)
        and the ledger of its job so far: what the failure cost stays in the run when no retry
        succeeds (a retry that does logs the ledger again, over every attempt). Never raises:
        the failure itself is what matters."""
        try:
            ti = context["ti"]
            parent = self.mlflow_run_id(context, spec)
            said = ("accepted: " if event["status"] == "success" else "") + str(event["message"])
            self.mlflow_hook.set_tags(parent, {f"{TAG_FAILED_TRY}.{ti.task_id}.{ti.try_number}":
                                               said[:MAX_TAG_CHARS]})
            result = event.get("result") or {}
            if event["status"] != "success" and result.get("final_step") is not None:
                prefix = f"{self.stage}/" if self.stage else ""
                reached = {f"train/{prefix}final_step": result.get("final_step"),
                           f"train/{prefix}tokens_seen": result.get("tokens_seen")}
                self.mlflow_hook.log_metrics(parent, {k: float(v) for k, v in reached.items()
                                                      if v is not None}, step=ti.try_number)
        except Exception:  # noqa: BLE001 - never mask the try's own failure
            self.log.warning("could not record the failed try in MLflow", exc_info=True)
            return
        self._record_ledger(context, spec, event, parent)

    def job_succeeded(self, context: Any, spec: PipelineSpec, event: dict[str, Any],
                      init: dict[str, str] | None = None,
                      pretrained: dict[str, Any] | None = None) -> dict[str, Any]:
        """Log the final step, tokens, loss and accounting; the task's XCom."""
        result = event.get("result") or {}
        ti = context["ti"]
        mlflow_run_id = self.mlflow_run_id(context, spec)
        final = {"train/final_step": result.get("final_step"),
                 "train/tokens_seen": result.get("tokens_seen"),
                 "train/final_loss": result.get("final_train_loss")}
        prefix = f"{self.stage}/" if self.stage else ""  # one series per stage
        ledger = self._record_ledger(context, spec, event, mlflow_run_id)
        # the ledger's window (every try and attempt), else the engine's wall time of this job
        wall_s = ledger.books.wall_s if ledger is not None else event.get("wall_s")
        if wall_s is not None:
            price = self._price(spec)
            usage = account(spec, wall_s, price)
            final.update({f"accounting/{prefix}{k}": v for k, v in usage.items()})
            self.log.info("Accounting: %.1f s wall, %.4f GPU-hours, %.4f CPU-core-hours, "
                          "%.4f %s, %.5f kWh", usage["wall_s"], usage["gpu_hours"],
                          usage["cpu_core_hours"], usage["cost"],
                          getattr(price, "currency", spec.cost.currency), usage["energy_kwh"])
        if self.stage:
            final = {k.replace("train/", f"train/{prefix}", 1): v for k, v in final.items()}
            self.mlflow_hook.end_run(self._stage_run_id(spec, mlflow_run_id), "FINISHED")
        self.mlflow_hook.log_metrics(  # at the try's number: one value per step, like the ledger
            mlflow_run_id, {k: float(v) for k, v in final.items() if v is not None},
            step=ti.try_number)
        if pretrained is None and spec.model.pretrained:  # resumed without the deferral's kwargs
            pretrained = self._pretrained(spec, ti.xcom_pull(task_ids=self.prepare_task_id),
                                          announce=False)  # said when the job was launched
        return {
            "stage": self.stage,
            # The job config's init and pretrained blocks: validation expects the same.
            "init": self._init_after_wait(spec, ti, init),
            "pretrained": pretrained,
            "job": event["handle"]["key"],
            "engine": spec.training.engine,
            "checkpoint_dir": self._checkpoint_dir(spec, ti),
            "last_checkpoint": result.get("last_checkpoint"),
            "final_step": result.get("final_step"),
            "tokens_seen": result.get("tokens_seen"),
            "final_train_loss": result.get("final_train_loss"),
            "mlflow_run_id": mlflow_run_id,
        }

    @staticmethod
    def _price(spec: PipelineSpec) -> Price | str:
        """The job's price (trainforge.ledger.catalog); a spec that names no catalog row fails
        the task without retries."""
        try:
            return choose_price(spec)
        except CatalogError as err:
            fail_permanently(f"cost: {err}")

    def _record_ledger(self, context: Any, spec: PipelineSpec, event: dict[str, Any],
                       parent: str) -> Ledger | None:
        """The job's ledger over every try so far, logged (trainforge.train_ledger); None
        when it could not be: never fails the task, the training it describes succeeded."""
        try:
            ti = context["ti"]
            records = task_records(
                ledger_dir(self._checkpoint_dir(spec, ti)),
                (lambda: connection_s3_client(spec)) if spec.storage.aws_conn_id else None)
            return record_ledger(self.mlflow_hook, spec, event, self._price(spec),
                          own_run=self._stage_run_id(spec, parent), parent_run=parent,
                          stage=self.stage, task_started_s=self._first_start_s,
                          try_number=int(ti.try_number), records=records)
        except Exception:  # noqa: BLE001 - the ledger is worth less than the model
            self.log.warning("could not record the job's ledger in MLflow", exc_info=True)
            return None

    def job_killed(self) -> None:
        """The task was killed: its MLflow run (a stage's: its child run) ends KILLED (a retry
        reopens it)."""
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
