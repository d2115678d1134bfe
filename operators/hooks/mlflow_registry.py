"""Model-registry calls of the eval gate: read the champion, tag versions, move aliases.

Aliases and version tags only, never the deprecated stages. Every call goes through the
``MlflowHook``'s client (same tracking URI, same HTTP timeouts and retries) and turns MLflow's
exceptions into `MlflowRequestError` naming the call and the version.

Tags written on a model version by the gate (``GATE_*``), and on the version that loses the
``champion`` alias (``TAG_SUPERSEDED_BY``), are listed in docs/registry.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.errors import MlflowRequestError
from trainforge.hooks.mlflow_calls import mlflow_errors

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
TAG_PREVIOUS_CHAMPION = "trainforge.previous_champion"
TAG_SUPERSEDED_BY = "trainforge.superseded_by"
TAG_PIPELINE_ALIAS_MOVE = "trainforge.pipeline_alias_move"
"""Prefix of ``<prefix>.<alias>`` (unix seconds), set on a version just before the pipeline moves
``alias`` to it: the webhook receiver then leaves that move's asset event to the pipeline
(trainforge.plugins.webhooks.receiver)."""
MAX_TAG_VALUE_CHARS = 5000  # mlflow.utils.validation.MAX_MODEL_REGISTRY_TAG_VALUE_LENGTH


class ModelRegistry:
    """The registry operations of one MLflow server, through ``hook``'s client.

    Raises (every method):
        MlflowRequestError: the server failed a call (after the client's own retries).
    """

    def __init__(self, hook: MlflowHook) -> None:
        self.hook = hook

    @property
    def client(self):
        return self.hook.client

    def version_with_alias(self, name: str, alias: str) -> dict[str, Any] | None:
        """``{"version", "tags", "run_id", ...}`` of the version ``alias`` points at, or None."""
        return self.hook.get_model_version_by_alias(name, alias)

    def version(self, name: str, version: str) -> dict[str, Any] | None:
        """``{"version", "run_id", "description", "aliases", "tags"}`` of ``name``
        v``version``, or None when it does not exist (never registered, or deleted)."""
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.get_model_version(name, str(version))
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise MlflowRequestError("get_model_version", f"{name} v{version}", err.error_code,
                                     err.message) from err
        return {"version": str(found.version), "run_id": found.run_id,
                "description": found.description or "", "aliases": sorted(found.aliases or []),
                "tags": dict(found.tags or {})}

    def set_version_tags(self, name: str, version: str, tags: Mapping[str, Any]) -> None:
        """Set each tag on ``name`` v``version`` (``str(value)``, cut to 5000 characters)."""
        for key, value in tags.items():
            with mlflow_errors("set_model_version_tag", f"{name} v{version} tag {key}"):
                self.client.set_model_version_tag(name, str(version), str(key),
                                                  str(value)[:MAX_TAG_VALUE_CHARS])

    def move_alias(self, name: str, alias: str, version: str) -> None:
        """Point ``alias`` of ``name`` at ``version`` (creates or moves it)."""
        with mlflow_errors("set_registered_model_alias", f"{name} alias {alias} -> v{version}"):
            self.client.set_registered_model_alias(name, alias, str(version))
        log.info("registered model %s: alias %s -> v%s", name, alias, version)

    def set_description(self, name: str, version: str, description: str) -> None:
        """Replace the description (model card) of ``name`` v``version``."""
        with mlflow_errors("update_model_version", f"{name} v{version}"):
            self.client.update_model_version(name, str(version), description=description)

    def aliases_of(self, name: str, version: str) -> list[str]:
        """The aliases pointing at ``name`` v``version``, sorted."""
        with mlflow_errors("get_model_version", f"{name} v{version}"):
            return sorted(self.client.get_model_version(name, str(version)).aliases or [])

    def promote(self, name: str, version: str, previous: str | None,
                tags: Mapping[str, Any]) -> None:
        """Make ``version`` the champion: tags first (with the previous champion), then the alias,
        then the previous champion's ``trainforge.superseded_by``.

        The order makes a crash safe to retry: the tags are rewritten, the alias moved once.
        """
        self.set_version_tags(name, version, {**tags, TAG_PREVIOUS_CHAMPION: previous or "none",
                                              f"{TAG_PIPELINE_ALIAS_MOVE}.{CHAMPION}":
                                                  f"{time.time():.0f}"})
        self.move_alias(name, CHAMPION, version)
        if previous and previous != str(version):
            self.set_version_tags(name, previous, {TAG_SUPERSEDED_BY: str(version)})
