"""MLflow hook: every call trainforge makes to the MLflow tracking server and model registry.

One MLflow run per DAG run (found by its tags), params/metrics/tags/artifacts/dataset inputs
logged into it, and one model version per idempotency key, waited on until READY before any
alias moves. ``mlflow`` is imported inside methods only: importing this module is cheap (DAG
parsing imports it).

Tracking URI: the ``tracking_uri`` argument, else ``$MLFLOW_TRACKING_URI``. The hook never puts
credentials into ``os.environ``; URIs with ``user:password@`` are refused. (Reading an Airflow
connection through ``conn_id`` is not implemented yet.)

Every HTTP call is bounded by MLflow's own client settings (``MLFLOW_HTTP_REQUEST_TIMEOUT``,
default 120 s per attempt, and ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``); every wait written here has
an interval and a deadline in seconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from trainforge.hooks.errors import (
    MlflowConfigError,
    MlflowInvalidArgumentError,
    MlflowParamConflictError,
    MlflowRegistrationError,
    MlflowRequestError,
    MlflowTimeoutError,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run
    from mlflow.entities.model_registry import ModelVersion

log = logging.getLogger(__name__)

TAG_DAG_ID = "trainforge.dag_id"
TAG_AIRFLOW_RUN_ID = "trainforge.airflow_run_id"
TAG_IDEMPOTENCY_KEY = "trainforge.idempotency_key"
TAG_DATASET_DIGEST = "trainforge.dataset_digest"
# MLflow's own input-tag key for a dataset's role (mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT).
DATASET_CONTEXT_TAG = "mlflow.data.context"
RUN_END_STATUSES = ("FINISHED", "FAILED", "KILLED")
# Dataset.digest holds at most 36 characters (mlflow.utils.validation.MAX_DATASET_DIGEST_SIZE);
# the full digest goes into the TAG_DATASET_DIGEST input tag.
MAX_DATASET_DIGEST_CHARS = 36
MAX_PARAM_VALUE_CHARS = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
_PIN_PACKAGES = ("transformers", "torch", "tokenizers", "safetensors")
_RUN_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._/-]+")
# mlflow.<flavor>.log_model resolves the *global* tracking URI; see _fluent_tracking_uri.
_FLUENT_LOCK = threading.Lock()


class MlflowHook:
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
            uri = self._uri_from_connection(self.conn_id)
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

    @staticmethod
    def _uri_from_connection(conn_id: str) -> str:
        from airflow.sdk import BaseHook

        try:
            conn = BaseHook.get_connection(conn_id)
        except Exception as err:  # noqa: BLE001 - Airflow raises several types for "not found"
            raise MlflowConfigError(
                f"Airflow connection {conn_id!r} for MLflow could not be read: {err}"
            ) from err
        if conn.login or conn.password:
            raise MlflowConfigError(
                f"Airflow connection {conn_id!r} carries a login or password; MLflow would need "
                "them in os.environ, which trainforge never writes: use an unauthenticated "
                "endpoint or a proxy"
            )
        if not conn.host:
            raise MlflowConfigError(f"Airflow connection {conn_id!r} has no host")
        scheme = conn.conn_type if conn.conn_type in ("http", "https") else "http"
        port = f":{conn.port}" if conn.port else ""
        return f"{scheme}://{conn.host}{port}{('/' + conn.schema) if conn.schema else ''}"

    @cached_property
    def client(self) -> MlflowClient:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    # --- runs -------------------------------------------------------------------------------

    def get_or_create_run(
        self,
        experiment_name: str,
        dag_id: str,
        run_id: str,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Return the id of THE MLflow run of DAG run (dag_id, run_id), creating it if missing.

        The run is found by its tags ``trainforge.dag_id`` and ``trainforge.airflow_run_id``
        (active runs only); ``tags`` are set on it either way (e.g. try numbers). Its status is
        left as found. A new run is named ``<dag_id>/<run_id>`` with unsafe characters replaced.

        Two concurrent callers: MLflow has no "create if absent", so each caller that created a
        run searches again and keeps the oldest matching run (start time, then run id: every
        caller picks the same one), deleting its own run if that is not the one. Both return the
        same id; a reader in between may briefly see two runs.

        Raises:
            MlflowConfigError: the experiment exists but is deleted.
            MlflowInvalidArgumentError: dag_id/run_id contain both ' and ".
            MlflowRequestError: the server failed a call.
        """
        extra_tags = {k: str(v) for k, v in (tags or {}).items()}
        target = f"DAG run {dag_id}/{run_id}"
        experiment_id = self._experiment_id(experiment_name)
        existing = self._runs_of_dag_run(experiment_id, dag_id, run_id)
        if existing:
            found = existing[0].info.run_id
            if extra_tags:
                self.set_tags(found, extra_tags)
            return found
        with _mlflow_errors("create_run", target):
            created = self.client.create_run(
                experiment_id,
                tags={TAG_DAG_ID: dag_id, TAG_AIRFLOW_RUN_ID: run_id, **extra_tags},
                run_name=_run_name(dag_id, run_id),
            ).info.run_id
        matching = self._runs_of_dag_run(experiment_id, dag_id, run_id)
        winner = matching[0].info.run_id if matching else created
        if winner != created:
            log.info(
                "MLflow run %s for %s lost a creation race to %s; deleting it",
                created,
                target,
                winner,
            )
            with _mlflow_errors("delete_run", created):
                self.client.delete_run(created)
            if extra_tags:
                self.set_tags(winner, extra_tags)
        else:
            log.info(
                "created MLflow run %s for %s in experiment %s", created, target, experiment_id
            )
        return winner

    def find_run(self, experiment_name: str, dag_id: str, run_id: str) -> str | None:
        """The id of the MLflow run of DAG run (dag_id, run_id), or None; creates nothing.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        with _mlflow_errors("get_experiment_by_name", f"experiment {experiment_name}"):
            experiment = self.client.get_experiment_by_name(experiment_name)
        if experiment is None:
            return None
        runs = self._runs_of_dag_run(str(experiment.experiment_id), dag_id, run_id)
        return runs[0].info.run_id if runs else None

    def child_runs(self, run_id: str) -> list[Run]:
        """The active runs whose ``mlflow.parentRunId`` tag is ``run_id`` (a staged pipeline's
        stage runs), in the parent's experiment, oldest first; any status.

        Raises:
            MlflowInvalidArgumentError: ``run_id`` contains both ' and ".
            MlflowRequestError: the server failed a call.
        """
        with _mlflow_errors("get_run", f"run {run_id}"):
            experiment_id = self.client.get_run(run_id).info.experiment_id
        query = f"tags.`mlflow.parentRunId` = {_quote('run_id', run_id)}"
        with _mlflow_errors("search_runs", f"child runs of run {run_id}"):
            runs = self.client.search_runs(
                [experiment_id], query, max_results=1000, order_by=["attributes.start_time ASC"]
            )
        return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Log params; values already logged with the same value are skipped (retries).

        Values are logged as ``str(value)``, cut to 6000 characters (MLflow's limit).

        Raises:
            MlflowParamConflictError: a key was logged before with a different value.
            MlflowRequestError: the server failed a call.
        """
        from mlflow.entities import Param

        given = {str(k): _param_value(v) for k, v in params.items()}
        with _mlflow_errors("get_run", f"run {run_id}"):
            logged = self.client.get_run(run_id).data.params
        conflicts = {k: (logged[k], v) for k, v in given.items() if k in logged and logged[k] != v}
        if conflicts:
            raise MlflowParamConflictError(run_id, conflicts)
        new = [Param(k, v) for k, v in given.items() if k not in logged]
        if new:
            with _mlflow_errors("log_batch(params)", f"run {run_id}"):
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
            with _mlflow_errors("log_batch(metrics)", f"run {run_id}"):
                self.client.log_batch(run_id, metrics=batch)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        """Set run tags (``str(value)``); setting a tag again overwrites it.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        from mlflow.entities import RunTag

        batch = [RunTag(str(k), str(v)) for k, v in tags.items()]
        if batch:
            with _mlflow_errors("log_batch(tags)", f"run {run_id}"):
                self.client.log_batch(run_id, tags=batch)

    def log_dict_artifact(
        self, run_id: str, obj: Mapping[str, Any] | Sequence[Any], path: str
    ) -> str:
        """Write ``obj`` as JSON (or YAML for ``.yaml``/``.yml``) to the run's artifact ``path``.

        Returns:
            ``runs:/<run_id>/<path>``.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        with _mlflow_errors("log_dict", f"run {run_id} artifact {path}"):
            self.client.log_dict(run_id, obj, path)  # type: ignore[arg-type]
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
        with _mlflow_errors("log_inputs", f"run {run_id} dataset {name}"):
            self.client.log_inputs(run_id, datasets=[dataset_input])

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Set the run's terminal status: FINISHED, FAILED or KILLED.

        Raises:
            MlflowInvalidArgumentError: another status.
            MlflowRequestError: the server failed a call.
        """
        if status not in RUN_END_STATUSES:
            raise MlflowInvalidArgumentError("run end status", status, f"one of {RUN_END_STATUSES}")
        with _mlflow_errors("set_terminated", f"run {run_id}"):
            self.client.set_terminated(run_id, status=status)

    # --- model registry ---------------------------------------------------------------------

    def register_model_version(
        self,
        run_id: str,
        model_dir: str | os.PathLike[str],
        registered_model_name: str,
        idempotency_key: str,
        aliases: Sequence[str] = (),
        description: str | None = None,
        tags: Mapping[str, Any] | None = None,
        ready_timeout_s: float = 300.0,
        poll_interval_s: float = 1.0,
        task: str = "text-generation",
        pip_requirements: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Register the Hugging Face model folder ``model_dir`` once per ``idempotency_key``.

        1. A version of ``registered_model_name`` tagged ``trainforge.idempotency_key`` =
           key exists (and is not FAILED_REGISTRATION): reuse it (``created`` False), wait
           until READY, set the aliases.
        2. Else log the folder with ``mlflow.transformers.log_model`` as a LoggedModel of run
           ``run_id`` (reusing a READY one this run already logged for the key), create the
           registered model if missing, create the version (key in its tags), wait until
           READY, then set each alias. The run's status is never changed.

        Same key, concurrent callers: whoever created a version searches again and keeps the
        lowest version with the key, deleting its own if that is not the one. Different keys
        get different versions.

        Returns:
            JSON-able ``{"name", "version", "aliases", "model_uri" (models:/name/version),
            "created", "model_id", "run_id"}``.

        Raises:
            MlflowInvalidArgumentError: the key contains both ' and ", or model_dir is missing.
            MlflowRegistrationError: the version is FAILED_REGISTRATION (no alias moved).
            MlflowTimeoutError: not READY after ``ready_timeout_s`` seconds (no alias moved).
            MlflowRequestError: the server failed a call.
        """
        name = registered_model_name
        existing = self._versions_with_key(name, idempotency_key)
        if existing:
            version, created = existing[0], False
            log.info(
                "%s v%s already has key %s; reusing it", name, version.version, idempotency_key
            )
        else:
            version, created = self._create_version(
                run_id,
                Path(model_dir),
                name,
                idempotency_key,
                description,
                {str(k): str(v) for k, v in (tags or {}).items()},
                task,
                pip_requirements,
            )
        ready = wait_model_version_ready(
            self.client, name, str(version.version), ready_timeout_s, poll_interval_s
        )
        for alias in aliases:
            with _mlflow_errors(
                "set_registered_model_alias", f"{name} alias {alias} -> v{ready.version}"
            ):
                self.client.set_registered_model_alias(name, alias, str(ready.version))
        with _mlflow_errors("get_model_version", f"{name} v{ready.version}"):
            final = self.client.get_model_version(name, str(ready.version))
        return {**_version_dict(final), "created": created}

    def find_model_version(self, name: str, idempotency_key: str) -> dict[str, Any] | None:
        """The usable version of ``name`` registered with ``idempotency_key`` (lowest), or None.

        Lets a retry skip the export and upload when its version already exists.

        Raises:
            MlflowInvalidArgumentError: the key contains both ' and ".
            MlflowRequestError: the server failed a call.
        """
        found = self._versions_with_key(name, idempotency_key)
        return _version_dict(found[0]) if found else None

    def get_model_version_by_alias(self, name: str, alias: str) -> dict[str, Any] | None:
        """The version ``alias`` points at, or None when the model or the alias does not exist.

        Reads the registered model's alias table rather than calling
        ``get_model_version_by_alias``, which answers a missing alias with the same
        INVALID_PARAMETER_VALUE code as a malformed request.

        Returns:
            ``{"name", "version", "aliases", "model_uri", "model_id", "run_id", "status",
            "tags", "source"}``.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        from mlflow.exceptions import MlflowException

        try:
            registered = self.client.get_registered_model(name)
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise MlflowRequestError(
                "get_registered_model", name, err.error_code, err.message
            ) from err
        version = (registered.aliases or {}).get(alias)
        if version is None:
            return None
        with _mlflow_errors("get_model_version", f"{name} v{version} (alias {alias})"):
            return _version_dict(self.client.get_model_version(name, str(version)))

    # --- helpers ----------------------------------------------------------------------------

    def _create_version(
        self,
        run_id: str,
        model_dir: Path,
        name: str,
        key: str,
        description: str | None,
        tags: dict[str, str],
        task: str,
        pip_requirements: Sequence[str] | None,
    ) -> tuple[ModelVersion, bool]:
        """Log the model, create a version with ``key``, settle a race; (version, created)."""
        model_path = model_dir.resolve()
        if not (model_path / "config.json").is_file():
            raise MlflowInvalidArgumentError(
                "model_dir", str(model_dir), "a Hugging Face model folder with config.json"
            )
        model_id = self._logged_model_for_key(run_id, model_path, key, task, pip_requirements)
        self._ensure_registered_model(name)
        with _mlflow_errors("create_model_version", f"registered model {name}"):
            mine = self.client.create_model_version(
                name,
                source=f"models:/{model_id}",
                run_id=run_id,
                tags={**tags, TAG_IDEMPOTENCY_KEY: key},
                description=description,
                await_creation_for=0,  # waited on by the caller, with its own deadline
                model_id=model_id,
            )
        winner = (self._versions_with_key(name, key) or [mine])[0]
        if winner.version == mine.version:
            log.info("created %s v%s (key %s) from %s", name, mine.version, key, model_id)
            return mine, True
        log.info(
            "%s v%s lost a race for key %s to v%s; deleting it",
            name,
            mine.version,
            key,
            winner.version,
        )
        with _mlflow_errors("delete_model_version", f"{name} v{mine.version}"):
            self.client.delete_model_version(name, mine.version)
        return winner, False

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        with _mlflow_errors("get_experiment_by_name", f"experiment {name}"):
            experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return str(self.client.create_experiment(name))
            except MlflowException as err:
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise MlflowRequestError(
                        "create_experiment", f"experiment {name}", err.error_code, err.message
                    ) from err
                with _mlflow_errors("get_experiment_by_name", f"experiment {name}"):
                    experiment = self.client.get_experiment_by_name(name)
        if experiment.lifecycle_stage == "deleted":
            raise MlflowConfigError(
                f"MLflow experiment {name!r} (id {experiment.experiment_id}) is deleted; restore "
                f"it (mlflow experiments restore --experiment-id {experiment.experiment_id}) or "
                "use another experiment name"
            )
        return str(experiment.experiment_id)

    def _runs_of_dag_run(self, experiment_id: str, dag_id: str, run_id: str) -> list[Run]:
        """Active runs tagged with (dag_id, run_id), oldest first (start time, then run id)."""
        query = (
            f"tags.`{TAG_DAG_ID}` = {_quote('dag_id', dag_id)} "
            f"AND tags.`{TAG_AIRFLOW_RUN_ID}` = {_quote('run_id', run_id)}"
        )
        with _mlflow_errors("search_runs", f"DAG run {dag_id}/{run_id}"):
            runs = self.client.search_runs(
                [experiment_id], query, max_results=100, order_by=["attributes.start_time ASC"]
            )
        return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))

    def _versions_with_key(self, name: str, key: str) -> list[ModelVersion]:
        """Versions of ``name`` tagged with ``key``, lowest first (all pages), failed ones left out.

        A FAILED_REGISTRATION version does not hold its key: a retry registers a new version.
        """
        query = (
            f"name = {_quote('registered_model_name', name)} "
            f"AND tags.`{TAG_IDEMPOTENCY_KEY}` = {_quote('idempotency_key', key)}"
        )
        found: list[ModelVersion] = []
        page_token = None
        while True:
            with _mlflow_errors("search_model_versions", f"registered model {name} key {key}"):
                page = self.client.search_model_versions(
                    query, max_results=100, page_token=page_token
                )
            found.extend(page)
            page_token = page.token
            if not page_token:
                break
        failed = [mv.version for mv in found if mv.status == "FAILED_REGISTRATION"]
        if failed:
            log.warning(
                "ignoring FAILED_REGISTRATION versions %s of %s with key %s", failed, name, key
            )
        usable = [mv for mv in found if mv.status != "FAILED_REGISTRATION"]
        return sorted(usable, key=lambda mv: int(mv.version))

    def _ensure_registered_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
            log.info("created registered model %s", name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise MlflowRequestError(
                    "create_registered_model", name, err.error_code, err.message
                ) from err

    def _logged_model_for_key(
        self,
        run_id: str,
        model_path: Path,
        key: str,
        task: str,
        pip_requirements: Sequence[str] | None,
    ) -> str:
        """Model id of a READY LoggedModel of ``run_id`` for ``key``; logs one if there is none.

        The LoggedModel is created with the client first so that it lands in the run's
        experiment (``log_model(run_id=...)`` alone would put it in the active/default
        experiment) and carries the key; ``log_model(model_id=...)`` then uploads into it
        without starting, activating or ending any run.
        """
        import mlflow
        from mlflow.entities import LoggedModelStatus

        with _mlflow_errors("get_run", f"run {run_id}"):
            experiment_id = self.client.get_run(run_id).info.experiment_id
        query = (
            f"tags.`{TAG_IDEMPOTENCY_KEY}` = {_quote('idempotency_key', key)} "
            f"AND source_run_id = {_quote('run_id', run_id)}"
        )
        with _mlflow_errors("search_logged_models", f"run {run_id} key {key}"):
            found = self.client.search_logged_models(
                [experiment_id], filter_string=query, max_results=50
            )
        ready = sorted(
            (m for m in found if m.status == LoggedModelStatus.READY),
            key=lambda m: m.creation_timestamp,
        )
        if ready:
            log.info("reusing logged model %s of run %s for key %s", ready[0].model_id, run_id, key)
            return str(ready[0].model_id)
        with _mlflow_errors("create_logged_model", f"run {run_id}"):
            model = self.client.create_logged_model(
                experiment_id=experiment_id,
                name="model",
                source_run_id=run_id,
                tags={TAG_IDEMPOTENCY_KEY: key},
            )
        with (
            _mlflow_errors("transformers.log_model", f"run {run_id} model {model.model_id}"),
            _fluent_tracking_uri(self.tracking_uri),
        ):
            mlflow.transformers.log_model(
                transformers_model=str(model_path),
                task=task,
                name="model",
                run_id=run_id,
                model_id=model.model_id,
                pip_requirements=list(pip_requirements or default_pip_requirements()),
            )
        return str(model.model_id)


def wait_model_version_ready(
    client: MlflowClient,
    name: str,
    version: str,
    timeout_s: float,
    interval_s: float = 1.0,
) -> ModelVersion:
    """Poll ``get_model_version`` every ``interval_s`` s until READY; return that version.

    Raises:
        MlflowRegistrationError: status FAILED_REGISTRATION (with MLflow's status message).
        MlflowTimeoutError: still not READY after ``timeout_s`` seconds (last status in it).
        MlflowRequestError: the server failed a call.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with _mlflow_errors("get_model_version", f"{name} v{version}"):
            mv = client.get_model_version(name, version)
        if mv.status == "READY":
            return mv
        if mv.status == "FAILED_REGISTRATION":
            raise MlflowRegistrationError(name, version, mv.status, mv.status_message)
        if time.monotonic() + interval_s > deadline:
            raise MlflowTimeoutError(
                f"model version {name} v{version} to become READY",
                timeout_s,
                f"{mv.status} ({mv.status_message or 'no status message'})",
            )
        time.sleep(interval_s)


def default_pip_requirements() -> list[str]:
    """Pinned requirements of a logged HF model: the installed versions, without local labels.

    Passed explicitly because mlflow.transformers' own default list adds ``torchvision``
    whenever torch is the engine and fails when torchvision is not installed.
    """
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for package in _PIN_PACKAGES:
        try:
            pins.append(f"{package}=={version(package).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return pins


def _version_dict(mv: ModelVersion) -> dict[str, Any]:
    return {
        "name": mv.name,
        "version": str(mv.version),
        "aliases": sorted(mv.aliases or []),
        "model_uri": f"models:/{mv.name}/{mv.version}",
        "model_id": getattr(mv, "model_id", None) or _model_id_from_source(mv.source),
        "run_id": mv.run_id,
        "status": mv.status,
        "tags": dict(mv.tags or {}),
        "source": mv.source,
    }


def _model_id_from_source(source: str | None) -> str | None:
    if source and source.startswith("models:/m-"):
        return source[len("models:/") :]
    return None


def _run_name(dag_id: str, run_id: str) -> str:
    return _RUN_NAME_UNSAFE.sub("_", f"{dag_id}/{run_id}")[:250]


def _param_value(value: Any) -> str:
    text = str(value)
    if len(text) > MAX_PARAM_VALUE_CHARS:
        log.warning("param value of %d characters cut to %d", len(text), MAX_PARAM_VALUE_CHARS)
    return text[:MAX_PARAM_VALUE_CHARS]


def _quote(argument: str, value: str) -> str:
    """Quote ``value`` for an MLflow search filter (MLflow has no escape inside quotes)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise MlflowInvalidArgumentError(argument, value, "a string without both ' and \" quotes")


@contextlib.contextmanager
def _mlflow_errors(operation: str, target: str) -> Iterator[None]:
    """Turn MLflow's exceptions into MlflowRequestError naming the operation and its target."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as err:
        raise MlflowRequestError(operation, target, err.error_code, err.message) from err


@contextlib.contextmanager
def _fluent_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's global tracking URI at ``uri`` for one fluent call, then restore it.

    ``Model.log`` (behind ``mlflow.transformers.log_model``) builds its client from the
    global tracking URI and ``mlflow.set_tracking_uri`` also writes ``MLFLOW_TRACKING_URI``
    into ``os.environ``. Both are restored exactly afterwards; the URI never holds credentials
    (refused in ``MlflowHook.tracking_uri``). A lock keeps threads of this process from
    interleaving.
    """
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_utils

    with _FLUENT_LOCK:
        saved_uri = getattr(tracking_utils, "_tracking_uri", None)
        saved_env = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(saved_uri)  # type: ignore[arg-type]
            if saved_env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = saved_env
