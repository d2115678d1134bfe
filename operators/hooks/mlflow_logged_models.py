"""Validated checkpoints as MLflow LoggedModels of the DAG run's run (mixed into ``MlflowHook``).

Each checkpoint the validator passed becomes one *external* LoggedModel (MLflow keeps no copy of
its files: tag ``trainforge.checkpoint`` and param ``checkpoint`` say where it lies, a local path
or an ``s3://`` URI), named ``step-<N>`` (``<stage>-step-<N>`` in a staged pipeline), with param
``step``, its validation metrics linked to it by model id and to the validation dataset by name
and digest (the UI's model comparison, `search_logged_models` by ``metrics.val_loss``), and its
validation report as the artifact ``validation_report.json`` (a metric the server refuses to link,
e.g. over a per-model quota, is a warning and ``trainforge.model_metrics.*`` tags on the model:
trainforge.hooks.mlflow_model_links). ``register_model`` then logs the
chosen checkpoint's Hugging Face export into that same LoggedModel, so the registered version's
source is ``models:/<its model id>`` (trainforge.hooks.mlflow_versions).

Idempotent: a checkpoint's model carries ``trainforge.checkpoint_key = <run id>:<location>``;
a retry finds the READY one and creates nothing. A model is created PENDING, filled, then marked
READY; a PENDING one left by a crash is deleted and made again.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainforge.hooks.mlflow_calls import mlflow_errors, quote
from trainforge.hooks.mlflow_model_links import MetricLink, link_metrics

log = logging.getLogger(__name__)

TAG_CHECKPOINT = "trainforge.checkpoint"
TAG_CHECKPOINT_KEY = "trainforge.checkpoint_key"
TAG_CHOSEN = "trainforge.validation.chosen"
TAG_KIND, KIND_CHECKPOINT = "trainforge.logged_model", "checkpoint"
REPORT_FILE = "validation_report.json"
MODEL_TYPE = "trainforge-checkpoint"


class LoggedModels:
    """LoggedModel calls of ``MlflowHook`` (needs its ``client`` and ``tracking_uri``)."""

    client: Any
    tracking_uri: str

    def log_checkpoint_model(self, run_id: str, checkpoint: str, step: int,
                             metrics: Mapping[str, float], report: Mapping[str, Any],
                             dataset: tuple[str, str] | None = None, stage: str | None = None,
                             tags: Mapping[str, str] | None = None) -> str:
        """The model id of ``checkpoint``'s LoggedModel in run ``run_id``, made when missing.

        Args:
            checkpoint: where the checkpoint lies (local path or ``s3://`` URI).
            step: its optimizer step.
            metrics: validation metrics (name -> value), logged at ``step``.
            report: its validation report (JSON-serialisable).
            dataset: ``(name, digest)`` of the run's dataset input the metrics were measured on.
            tags: more tags (e.g. `TAG_CHOSEN`), set on a found model too.

        Raises:
            MlflowInvalidArgumentError: the checkpoint location holds both ' and ".
            MlflowRequestError: the server failed a call.
        """
        from mlflow.entities import LoggedModelStatus

        key = f"{run_id}:{checkpoint}"
        extra_tags = {str(k): str(v) for k, v in (tags or {}).items()}
        found = self._checkpoint_models(run_id, key)
        ready = [m for m in found if m.status == LoggedModelStatus.READY]
        for stale in (m for m in found if m.status != LoggedModelStatus.READY):
            with mlflow_errors("delete_logged_model", f"logged model {stale.model_id}"):
                self.client.delete_logged_model(stale.model_id)
        if ready:
            if extra_tags:
                with mlflow_errors("set_logged_model_tags", f"logged model {ready[0].model_id}"):
                    self.client.set_logged_model_tags(ready[0].model_id, extra_tags)
            return str(ready[0].model_id)
        with mlflow_errors("get_run", f"run {run_id}"):
            experiment_id = self.client.get_run(run_id).info.experiment_id
        name = f"{stage}-step-{step}" if stage else f"step-{step}"
        with mlflow_errors("create_logged_model", f"run {run_id} checkpoint {checkpoint}"):
            model = self.client.create_logged_model(
                experiment_id=experiment_id, name=name, source_run_id=run_id,
                model_type=MODEL_TYPE, params={"checkpoint": checkpoint, "step": str(step)},
                tags={"mlflow.model.isExternal": "true", TAG_KIND: KIND_CHECKPOINT,
                      TAG_CHECKPOINT: checkpoint,
                      TAG_CHECKPOINT_KEY: key, "trainforge.checkpoint_step": str(step),
                      **({"trainforge.stage": stage} if stage else {}), **extra_tags})
        links = link_metrics(self.client, run_id, model.model_id, [
            MetricLink(str(k), float(v), step, dataset) for k, v in metrics.items()])
        if not links.complete:  # a quota refusal: the checkpoint is still valid, and registered
            log.warning("%s", links.warning(model.model_id))
            with mlflow_errors("set_logged_model_tags", f"logged model {model.model_id}"):
                self.client.set_logged_model_tags(model.model_id, links.tags())
        self._log_external_files(model, report)
        with mlflow_errors("finalize_logged_model", f"logged model {model.model_id}"):
            self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        return str(model.model_id)

    def best_checkpoint_model(self, run_id: str, metric: str = "val_loss",
                              lowest: bool = True) -> dict[str, Any] | None:
        """``{"model_id", "name", "checkpoint", "step", "value"}`` of the READY checkpoint
        model of ``run_id`` with the lowest (or highest) ``metric``, found with MLflow's
        ``search_logged_models``; None when no checkpoint model has the metric.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        with mlflow_errors("get_run", f"run {run_id}"):
            experiment_id = self.client.get_run(run_id).info.experiment_id
        query = (f"source_run_id = {quote('run_id', run_id)} "
                 f"AND tags.`{TAG_KIND}` = '{KIND_CHECKPOINT}'")
        order = [{"field_name": f"metrics.{metric}", "ascending": lowest}]
        with mlflow_errors("search_logged_models", f"checkpoints of run {run_id} by {metric}"):
            found = self.client.search_logged_models([experiment_id], filter_string=query,
                                                     order_by=order, max_results=100)
        for model in found:
            values = [m.value for m in model.metrics or [] if m.key == metric]
            if values and str(model.status) == "READY":
                return {"model_id": model.model_id, "name": model.name,
                        "checkpoint": model.tags.get(TAG_CHECKPOINT),
                        "step": int(model.params["step"]), "value": values[-1]}
        return None

    def _checkpoint_models(self, run_id: str, key: str) -> list[Any]:
        with mlflow_errors("get_run", f"run {run_id}"):
            experiment_id = self.client.get_run(run_id).info.experiment_id
        query = (f"tags.`{TAG_CHECKPOINT_KEY}` = {quote('checkpoint', key)} "
                 f"AND source_run_id = {quote('run_id', run_id)}")
        with mlflow_errors("search_logged_models", f"run {run_id} checkpoint key {key}"):
            return list(self.client.search_logged_models([experiment_id], filter_string=query,
                                                         max_results=50))

    def _log_external_files(self, model: Any, report: Mapping[str, Any]) -> None:
        """The report and MLflow's MLmodel stub of an external model (what lets it be
        registered, as ``mlflow.create_external_model`` writes it)."""
        from mlflow.models.model import MLMODEL_FILE_NAME
        from mlflow.models.utils import get_external_mlflow_model_spec

        with tempfile.TemporaryDirectory(prefix="trainforge-logged-model-") as tmp:
            get_external_mlflow_model_spec(model).save(str(Path(tmp) / MLMODEL_FILE_NAME))
            (Path(tmp) / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str),
                                                 encoding="utf-8")
            with mlflow_errors("log_model_artifacts", f"logged model {model.model_id}"):
                self.client.log_model_artifacts(model.model_id, tmp)
