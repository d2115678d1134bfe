"""Model versions in the MLflow registry: one version per idempotency key, from a LoggedModel
of the run, waited on until READY before any alias moves.

:class:`ModelVersions` is a part of :class:`~trainforge.hooks.mlflow.MlflowHook` (a mixin over
its ``client`` and ``tracking_uri``); callers use the hook. ``mlflow`` is imported inside
methods only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.hooks.errors import (
    MlflowInvalidArgumentError,
    MlflowRegistrationError,
    MlflowRequestError,
    MlflowTimeoutError,
)
from trainforge.hooks.mlflow_calls import fluent_tracking_uri, mlflow_errors, quote

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

log = logging.getLogger(__name__)

TAG_IDEMPOTENCY_KEY = "trainforge.idempotency_key"
_PIN_PACKAGES = ("transformers", "torch", "tokenizers", "safetensors")


class ModelVersions:
    """Registering and finding model versions (needs ``self.client`` and ``self.tracking_uri``).

    Raises (every method):
        MlflowRequestError: the server failed a call (after the client's own retries).
    """

    client: MlflowClient
    tracking_uri: str

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
        logged_model_id: str | None = None,
    ) -> dict[str, Any]:
        """Register the Hugging Face model folder ``model_dir`` once per ``idempotency_key``.

        1. A version of ``registered_model_name`` tagged ``trainforge.idempotency_key`` =
           key exists (and is not FAILED_REGISTRATION): reuse it (``created`` False), wait
           until READY, set the aliases.
        2. Else log the folder with ``mlflow.transformers.log_model`` as a LoggedModel of run
           ``run_id`` (reusing a READY one this run already logged for the key; with
           ``logged_model_id``, the checkpoint's own LoggedModel receives the files:
           trainforge.hooks.mlflow_logged_models), create the
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
                logged_model_id,
            )
        ready = wait_model_version_ready(
            self.client, name, str(version.version), ready_timeout_s, poll_interval_s
        )
        for alias in aliases:
            with mlflow_errors(
                "set_registered_model_alias", f"{name} alias {alias} -> v{ready.version}"
            ):
                self.client.set_registered_model_alias(name, alias, str(ready.version))
        with mlflow_errors("get_model_version", f"{name} v{ready.version}"):
            final = self.client.get_model_version(name, str(ready.version))
        return {**version_dict(final), "created": created}

    def find_model_version(self, name: str, idempotency_key: str) -> dict[str, Any] | None:
        """The usable version of ``name`` registered with ``idempotency_key`` (lowest), or None.

        Lets a retry skip the export and upload when its version already exists.

        Raises:
            MlflowInvalidArgumentError: the key contains both ' and ".
            MlflowRequestError: the server failed a call.
        """
        found = self._versions_with_key(name, idempotency_key)
        return version_dict(found[0]) if found else None

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
        with mlflow_errors("get_model_version", f"{name} v{version} (alias {alias})"):
            return version_dict(self.client.get_model_version(name, str(version)))

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
        logged_model_id: str | None,
    ) -> tuple[ModelVersion, bool]:
        """Log the model, create a version with ``key``, settle a race; (version, created)."""
        model_path = model_dir.resolve()
        if not (model_path / "config.json").is_file():
            raise MlflowInvalidArgumentError(
                "model_dir", str(model_dir), "a Hugging Face model folder with config.json"
            )
        model_id = self._logged_model_for_key(run_id, model_path, key, task, pip_requirements,
                                              logged_model_id)
        self._ensure_registered_model(name)
        with mlflow_errors("create_model_version", f"registered model {name}"):
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
        with mlflow_errors("delete_model_version", f"{name} v{mine.version}"):
            self.client.delete_model_version(name, mine.version)
        return winner, False

    def _versions_with_key(self, name: str, key: str) -> list[ModelVersion]:
        """Versions of ``name`` tagged with ``key``, lowest first (all pages), failed ones left out.

        A FAILED_REGISTRATION version does not hold its key: a retry registers a new version.
        """
        query = (
            f"name = {quote('registered_model_name', name)} "
            f"AND tags.`{TAG_IDEMPOTENCY_KEY}` = {quote('idempotency_key', key)}"
        )
        found: list[ModelVersion] = []
        page_token = None
        while True:
            with mlflow_errors("search_model_versions", f"registered model {name} key {key}"):
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
        logged_model_id: str | None = None,
    ) -> str:
        """Model id of a READY LoggedModel of ``run_id`` for ``key``; logs one if there is none
        (into ``logged_model_id``, the validated checkpoint's external LoggedModel, when given:
        its MLmodel stub is replaced by the ``transformers`` flavour, and MLflow drops its
        external tag).

        The LoggedModel is created with the client first so that it lands in the run's
        experiment (``log_model(run_id=...)`` alone would put it in the active/default
        experiment) and carries the key; ``log_model(model_id=...)`` then uploads into it
        without starting, activating or ending any run.
        """
        import mlflow
        from mlflow.entities import LoggedModelStatus

        with mlflow_errors("get_run", f"run {run_id}"):
            experiment_id = self.client.get_run(run_id).info.experiment_id
        query = (
            f"tags.`{TAG_IDEMPOTENCY_KEY}` = {quote('idempotency_key', key)} "
            f"AND source_run_id = {quote('run_id', run_id)}"
        )
        with mlflow_errors("search_logged_models", f"run {run_id} key {key}"):
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
        if logged_model_id is not None:
            with mlflow_errors("get_logged_model", f"logged model {logged_model_id}"):
                model = self.client.get_logged_model(logged_model_id)
        else:
            with mlflow_errors("create_logged_model", f"run {run_id}"):
                model = self.client.create_logged_model(
                    experiment_id=experiment_id,
                    name="model",
                    source_run_id=run_id,
                    tags={TAG_IDEMPOTENCY_KEY: key},
                )
        with (
            mlflow_errors("transformers.log_model", f"run {run_id} model {model.model_id}"),
            fluent_tracking_uri(self.tracking_uri),
        ):
            mlflow.transformers.log_model(
                transformers_model=str(model_path),
                task=task,
                name="model",
                run_id=run_id,
                model_id=model.model_id,
                pip_requirements=list(pip_requirements or default_pip_requirements()),
            )
        if logged_model_id is not None:  # the key last: a crash before it logs the files again
            with mlflow_errors("set_logged_model_tags", f"logged model {model.model_id}"):
                self.client.set_logged_model_tags(model.model_id, {TAG_IDEMPOTENCY_KEY: key})
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
        with mlflow_errors("get_model_version", f"{name} v{version}"):
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


def version_dict(mv: ModelVersion) -> dict[str, Any]:
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
