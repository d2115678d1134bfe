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
from trainforge.hooks.mlflow_calls import mlflow_errors, quote
from trainforge.hooks.mlflow_model_links import (
    ADAPTER_CONFIG,
    TAG_IDEMPOTENCY_KEY,
    MetricLink,
    VersionModels,
    link_metrics,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

log = logging.getLogger(__name__)



class ModelVersions(VersionModels):
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
        metric_links: Sequence[MetricLink] = (),
        step: int = 0,
    ) -> dict[str, Any]:
        """Register the Hugging Face model folder ``model_dir`` once per ``idempotency_key``.

        1. A version of ``registered_model_name`` tagged ``trainforge.idempotency_key`` =
           key exists (and is not FAILED_REGISTRATION): reuse it (``created`` False), wait
           until READY, set the aliases.
        2. Else put the folder as a ``transformers`` model into a LoggedModel of run
           ``run_id`` (output at ``step``; reusing a READY one this run already logged for the
           key; with ``logged_model_id``, the checkpoint's own LoggedModel receives the files:
           trainforge.hooks.mlflow_logged_models), link ``metric_links`` to it and nothing
           else (trainforge.hooks.mlflow_model_links: a refused link is a warning and the
           version's ``trainforge.model_metrics.*`` tags, never an error), create the
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
                metric_links,
                step,
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
        metric_links: Sequence[MetricLink] = (),
        step: int = 0,
    ) -> tuple[ModelVersion, bool]:
        """Log the model, link its metrics, create a version with ``key``, settle a race;
        (version, created)."""
        model_path = model_dir.resolve()
        if not any((model_path / name).is_file() for name in ("config.json", ADAPTER_CONFIG)):
            raise MlflowInvalidArgumentError(
                "model_dir", str(model_dir),
                f"a Hugging Face model folder with config.json (or a LoRA adapter's {ADAPTER_CONFIG})",
            )
        model_id = self._logged_model_for_key(run_id, model_path, key, task, pip_requirements,
                                              logged_model_id, step)
        links = link_metrics(self.client, run_id, model_id, metric_links)
        if not links.complete:
            log.warning("%s", links.warning(model_id))
        tags = {**tags, **links.tags()}
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
