"""What every trainforge stage operator shares: the spec, trigger-time params, the MLflow run.

Operators hold the spec as plain JSON (cheap to build at DAG-parse time) and re-validate it,
with the DAG run's params applied, when the task runs: a bad override fails the task before
anything is launched, naming the field.
"""

from __future__ import annotations

import subprocess
import sys
import time
from functools import cached_property
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from trainforge.callbacks import try_started_tag
from trainforge.hooks.mlflow import MlflowHook
from trainforge.pipeline.loader import SpecError, validate_overrides
from trainforge.pipeline.spec import PipelineSpec
from trainforge.plugins.links import XCOM_MLFLOW_RUN_URL, MlflowRunLink

# DAG param name -> dotted spec path. These are the fields a researcher may override in the
# Airflow UI's trigger form; the DAG builder turns each into a typed Param. They change the
# top-level `training`; with `stages`, every stage inherits the new value unless its own
# `training` block sets that field (docs/stages.md, "Trigger-form params").
TUNABLE_PARAMS: dict[str, str] = {
    "max_steps": "training.optimization.max_steps",
    "learning_rate": "training.optimization.learning_rate",
    "warmup_steps": "training.optimization.warmup_steps",
    "global_batch_size": "training.optimization.global_batch_size",
    "micro_batch_size": "training.optimization.micro_batch_size",
    "seed": "training.optimization.seed",
    "checkpoint_interval_steps": "training.checkpoint.interval_steps",
}


def _try_started(ti: Any) -> dict[str, str]:
    """The tag saying this try of the task began: a callback for an older try then changes
    nothing (trainforge.callbacks)."""
    try_number = getattr(ti, "try_number", None)
    return {try_started_tag(ti.task_id): str(int(try_number))} if try_number else {}


def fail_permanently(message: str) -> None:
    """Fail the task without retries (a retry cannot fix it)."""
    raise AirflowFailException(message)


class TrainforgeStageOperator(BaseOperator):
    """Base of the four stage operators.

    Args:
        spec: the validated pipeline spec as JSON (``PipelineSpec.model_dump(mode="json")``).
        spec_file: the YAML file it came from (for messages).
        mlflow_tracking_uri: tracking server; default: ``MLFLOW_TRACKING_URI`` of the worker.
    """

    ui_color = "#e8f1fb"
    operator_extra_links = (MlflowRunLink(),)

    def __init__(
        self,
        *,
        spec: dict[str, Any],
        spec_file: str = "",
        mlflow_tracking_uri: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.spec = spec
        self.spec_file = spec_file
        self.mlflow_tracking_uri = mlflow_tracking_uri

    # -- spec -------------------------------------------------------------------------------
    def resolved_spec(self, context: Any) -> PipelineSpec:
        """The spec with this DAG run's param overrides, validated by the spec model."""
        params = dict(context.get("params") or {})
        base = PipelineSpec.model_validate(self.spec)
        overrides = {}
        for name, path in TUNABLE_PARAMS.items():
            if name in params and params[name] is not None:
                overrides[path] = params[name]
        try:
            return validate_overrides(base, overrides)
        except SpecError as err:
            fail_permanently(f"invalid trigger parameters for {base.dag_id}:\n{err}")
            raise  # unreachable; keeps type checkers quiet

    # -- MLflow -----------------------------------------------------------------------------
    @cached_property
    def mlflow_hook(self):
        return MlflowHook(tracking_uri=self.mlflow_tracking_uri)

    def mlflow_run_id(self, context: Any, spec: PipelineSpec) -> str:
        """The DAG run's MLflow run (created by the first task that asks, found by the rest)."""
        ti = context["ti"]
        run_id = self.mlflow_hook.get_or_create_run(
            experiment_name=spec.experiment_name,
            dag_id=ti.dag_id,
            run_id=ti.run_id,
            tags={"trainforge.pipeline": spec.dag_id, "trainforge.spec_file": self.spec_file,
                  **_try_started(ti)},
        )
        self._record_run_link(ti, run_id)
        return run_id

    def link_mlflow_run(self, context: Any, spec: PipelineSpec) -> None:
        """Record the DAG run's MLflow run as this task's link without creating the run (tasks
        that never log to it: the approval, the teardown). An empty link when there is none,
        so Airflow always finds the key it reads at the end of the task."""
        ti = context["ti"]
        try:
            run_id = self.mlflow_hook.find_run(spec.experiment_name, ti.dag_id, ti.run_id)
            if run_id is not None:
                self.mlflow_hook.set_tags(run_id, _try_started(ti))
        except Exception:  # noqa: BLE001 - the link is a convenience, never a failure
            self.log.debug("could not find the MLflow run for its link", exc_info=True)
            run_id = None
        self._record_run_link(ti, run_id)

    def _record_run_link(self, ti: Any, run_id: str | None) -> None:
        url = ""
        try:
            if run_id:
                experiment_id = self.mlflow_hook.get_run(run_id).info.experiment_id
                url = (f"{self.mlflow_hook.tracking_uri.rstrip('/')}/#/experiments/"
                       f"{experiment_id}/runs/{run_id}")
        except Exception:  # noqa: BLE001 - the link is a convenience, never a failure
            self.log.debug("could not build the MLflow run link", exc_info=True)
        try:
            ti.xcom_push(key=XCOM_MLFLOW_RUN_URL, value=url)
        except Exception:  # noqa: BLE001
            self.log.debug("could not record the MLflow run link", exc_info=True)

    # -- helpers ----------------------------------------------------------------------------
    def run_streaming(self, argv: list[str], timeout_s: float, env: dict | None = None) -> int:
        """Run a child process, passing each output line to the task log as it arrives.

        Returns the exit code. Raises :class:`subprocess.TimeoutExpired` after ``timeout_s``
        (the child is killed first).
        """
        self.log.info("Running: %s", " ".join(argv))
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            stdin=subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                self.log.info("%s", line.rstrip())
                if time.monotonic() - started > timeout_s:
                    raise subprocess.TimeoutExpired(argv, timeout_s)
            return proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        except BaseException:
            proc.kill()
            proc.wait()
            raise

    @staticmethod
    def python() -> str:
        return sys.executable
