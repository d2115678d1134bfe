"""MLflow hook: every call trainforge makes to the MLflow tracking server and model registry.

One MLflow run per DAG run, found or created by its tags, and a staged pipeline's stage runs
(trainforge.hooks.mlflow_runs); params/metrics/tags/artifacts/dataset inputs logged into a run
(this module); one model version per idempotency key, waited on until READY before any alias
moves (trainforge.hooks.mlflow_versions); a model version's files found and downloaded (trainforge.hooks.mlflow_artifacts); validated checkpoints as LoggedModels
(trainforge.hooks.mlflow_logged_models). ``mlflow`` is imported inside methods only:
importing these modules is cheap (DAG parsing imports them).

Tracking URI: the ``tracking_uri`` argument, else ``$MLFLOW_TRACKING_URI``. The hook never puts
credentials into ``os.environ``; URIs with ``user:password@`` are refused. (Reading an Airflow
connection through ``conn_id`` is not implemented yet.)

Every HTTP call is bounded by MLflow's own client settings (``MLFLOW_HTTP_REQUEST_TIMEOUT``,
default 120 s per attempt, and ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``); every wait written here has
an interval and a deadline in seconds.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from trainforge.hooks.errors import (
    MlflowConfigError,
    MlflowInvalidArgumentError,
    MlflowParamConflictError,
)
from trainforge.hooks.mlflow_artifacts import ModelArtifacts
from trainforge.hooks.mlflow_calls import mlflow_errors, tracking_uri_from_connection
from trainforge.hooks.mlflow_logged_models import LoggedModels
from trainforge.hooks.mlflow_runs import DagRuns
from trainforge.hooks.mlflow_versions import ModelVersions

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

TAG_FAILED_TRY = "trainforge.failed_try"
"""Prefix of ``trainforge.failed_try.<task_id>.<try>`` on the DAG run's run: why that try failed."""
TAG_DATASET_DIGEST = "trainforge.dataset_digest"
# MLflow's own input-tag key for a dataset's role (mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT).
DATASET_CONTEXT_TAG = "mlflow.data.context"
RUN_END_STATUSES = ("FINISHED", "FAILED", "KILLED")
# Dataset.digest holds at most 36 characters (mlflow.utils.validation.MAX_DATASET_DIGEST_SIZE);
# the full digest goes into the TAG_DATASET_DIGEST input tag.
MAX_DATASET_DIGEST_CHARS = 36
MAX_PARAM_VALUE_CHARS = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH


class MlflowHook(DagRuns, ModelVersions, ModelArtifacts, LoggedModels):
    """Client-side access to one MLflow tracking server (and its model registry).

    Args:
        tracking_uri: ``http(s)://host:port`` of the server; default ``$MLFLOW_TRACKING_URI``.
        conn_id: an Airflow connection whose type is the scheme (``http``/``https``) and whose
            host and port name the server, e.g. ``AIRFLOW_CONN_MLFLOW_DEFAULT=http://mlflow:5000``.
            Used when ``tracking_uri`` is not given. Login and password are refused: MLflow
            would need them in ``os.environ``, which this hook never writes.

    Raises (on first use, from ``tracking_uri``/``client``):
        MlflowConfigError: no URI, a URI or connection carrying credentials, or an unknown
            connection.
    """

    def __init__(self, tracking_uri: str | None = None, conn_id: str | None = None) -> None:
        self.conn_id = conn_id
        self._tracking_uri_arg = tracking_uri

    @cached_property
    def tracking_uri(self) -> str:
        uri = self._tracking_uri_arg
        if uri is None and self.conn_id is not None:
            uri = tracking_uri_from_connection(self.conn_id)
        uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise MlflowConfigError(
                "no MLflow tracking URI: pass MlflowHook(tracking_uri=...) or set "
                "MLFLOW_TRACKING_URI (e.g. http://127.0.0.1:5000)"
            )
        parsed = urlparse(uri)
        if parsed.username or parsed.password:
            raise MlflowConfigError(
                f"the MLflow tracking URI for host {parsed.hostname!r} carries credentials; "
                "remove user:password@ from it (credentials never go into URIs or os.environ)"
            )
        return uri

    @cached_property
    def client(self) -> MlflowClient:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Log params; values already logged with the same value are skipped (retries).

        Values are logged as ``str(value)``, cut to 6000 characters (MLflow's limit).

        Raises:
            MlflowParamConflictError: a key was logged before with a different value.
            MlflowRequestError: the server failed a call.
        """
        from mlflow.entities import Param

        given = {str(k): _param_value(v) for k, v in params.items()}
        with mlflow_errors("get_run", f"run {run_id}"):
            logged = self.client.get_run(run_id).data.params
        conflicts = {k: (logged[k], v) for k, v in given.items() if k in logged and logged[k] != v}
        if conflicts:
            raise MlflowParamConflictError(run_id, conflicts)
        new = [Param(k, v) for k, v in given.items() if k not in logged]
        if new:
            with mlflow_errors("log_batch(params)", f"run {run_id}"):
                self.client.log_batch(run_id, params=new)

    def log_metrics(
        self, run_id: str, metrics: Mapping[str, float], step: int | None = None
    ) -> None:
        """Log metrics at ``step`` (default 0) with the current time.

        Raises:
            MlflowInvalidArgumentError: a value is not a number.
            MlflowRequestError: the server failed a call.
        """
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError) as err:
                raise MlflowInvalidArgumentError(f"metric {key!r}", value, "a number") from err
            batch.append(Metric(str(key), number, timestamp_ms, step or 0))
        if batch:
            with mlflow_errors("log_batch(metrics)", f"run {run_id}"):
                self.client.log_batch(run_id, metrics=batch)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        """Set run tags (``str(value)``); setting a tag again overwrites it.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        from mlflow.entities import RunTag

        batch = [RunTag(str(k), str(v)) for k, v in tags.items()]
        if batch:
            with mlflow_errors("log_batch(tags)", f"run {run_id}"):
                self.client.log_batch(run_id, tags=batch)

    def delete_tags(self, run_id: str, keys: Sequence[str]) -> None:
        """Remove run tags ``keys``; a key the run does not have is skipped.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        with mlflow_errors("get_run", f"run {run_id}"):
            present = self.client.get_run(run_id).data.tags
        for key in keys:
            if key in present:
                with mlflow_errors("delete_tag", f"run {run_id} tag {key}"):
                    self.client.delete_tag(run_id, key)

    def log_dict_artifact(
        self, run_id: str, obj: Mapping[str, Any] | Sequence[Any], path: str
    ) -> str:
        """Write ``obj`` as JSON (or YAML for ``.yaml``/``.yml``) to the run's artifact ``path``.

        Returns:
            ``runs:/<run_id>/<path>``.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        with mlflow_errors("log_dict", f"run {run_id} artifact {path}"):
            self.client.log_dict(run_id, obj, path)  # type: ignore[arg-type]
        return f"runs:/{run_id}/{path}"

    def log_table(self, run_id: str, columns: Mapping[str, Sequence[Any]], path: str) -> str:
        """Log ``{column: values}`` as a table artifact (MLflow's table JSON, listed among the
        run's tables) at the run's ``path`` (ends in ``.json``), unless ``path`` exists already:
        MLflow appends to an existing table, so a retry would double its rows. Name a table after
        what determines its rows.

        Returns:
            ``runs:/<run_id>/<path>``.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        folder = path.rpartition("/")[0] or None
        with mlflow_errors("list_artifacts", f"run {run_id} folder {folder}"):
            present = {f.path for f in self.client.list_artifacts(run_id, folder)}
        if path in present:
            log.info("run %s already holds table %s: not logging it again", run_id, path)
            return f"runs:/{run_id}/{path}"
        with mlflow_errors("log_table", f"run {run_id} artifact {path}"):
            self.client.log_table(run_id, {k: list(v) for k, v in columns.items()}, path)
        return f"runs:/{run_id}/{path}"

    def log_dataset_input(
        self,
        run_id: str,
        name: str,
        digest: str,
        source_uri: str,
        context: str = "training",
        extra_tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Record a dataset as an input of the run (the UI's Datasets column); idempotent.

        ``Dataset.digest`` keeps the first 36 characters of ``digest`` (MLflow's limit); the
        full digest is the input tag ``trainforge.dataset_digest``. The source type follows the
        URI scheme: ``local`` for paths and ``file:``, else the scheme (``s3``, ``http``).

        Raises:
            MlflowRequestError: the server failed a call.
        """
        from mlflow.entities import Dataset, DatasetInput, InputTag

        scheme = urlparse(source_uri).scheme
        source_type = "local" if scheme in ("", "file") else "http" if scheme == "https" else scheme
        dataset = Dataset(
            name=name,
            digest=digest[:MAX_DATASET_DIGEST_CHARS],
            source_type=source_type,
            source=json.dumps({"uri": source_uri}),
        )
        tags = {DATASET_CONTEXT_TAG: context, TAG_DATASET_DIGEST: digest}
        tags.update({str(k): str(v) for k, v in (extra_tags or {}).items()})
        dataset_input = DatasetInput(dataset, tags=[InputTag(k, v) for k, v in tags.items()])
        with mlflow_errors("log_inputs", f"run {run_id} dataset {name}"):
            self.client.log_inputs(run_id, datasets=[dataset_input])

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Set the run's terminal status: FINISHED, FAILED or KILLED.

        Raises:
            MlflowInvalidArgumentError: another status.
            MlflowRequestError: the server failed a call.
        """
        if status not in RUN_END_STATUSES:
            raise MlflowInvalidArgumentError("run end status", status, f"one of {RUN_END_STATUSES}")
        with mlflow_errors("set_terminated", f"run {run_id}"):
            self.client.set_terminated(run_id, status=status)


def _param_value(value: Any) -> str:
    text = str(value)
    if len(text) > MAX_PARAM_VALUE_CHARS:
        log.warning("param value of %d characters cut to %d", len(text), MAX_PARAM_VALUE_CHARS)
    return text[:MAX_PARAM_VALUE_CHARS]
