"""The files of registered model versions: resolve ``models:/`` URIs, find and download files.

A model version's files are those of its LoggedModel (``models:/m-...`` source), or of the run
path it was registered from (``runs:/<run>/<path>``), or any other artifact location it names.
:class:`ModelArtifacts` is a part of :class:`~trainforge.hooks.mlflow.MlflowHook` (a mixin over
its ``client`` and ``tracking_uri``); callers use the hook. ``mlflow`` is imported inside
methods only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.hooks.errors import MlflowModelSourceError
from trainforge.hooks.mlflow_calls import mlflow_errors

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

MODELS_URI = re.compile(r"^models:/([^/@]+)(?:@([^/]+)|/([0-9]+))$")


class ModelVersionFiles:
    """The artifact files of one model version (an MLflow artifact repository).

    Raises (every method):
        MlflowRequestError: the artifact store failed a call.
    """

    def __init__(self, repository: Any, what: str) -> None:
        self._repo = repository
        self._what = what

    @property
    def root_uri(self) -> str:
        """The artifact root, e.g. ``s3://bucket/.../artifacts`` or a local path."""
        return str(getattr(self._repo, "artifact_uri", "") or "")

    def find(self, filename: str, depth: int) -> str | None:
        """The shallowest file named ``filename`` (path relative to the root), searched breadth
        first down to ``depth`` folders below the root; ties by path. None when absent."""
        level = [""]
        for _ in range(depth + 1):
            with mlflow_errors("list_artifacts", self._what):
                entries = [f for folder in level for f in self._repo.list_artifacts(folder)]
            files = sorted(f.path for f in entries
                           if not f.is_dir and f.path.rsplit("/", 1)[-1] == filename)
            if files:
                return files[0]
            level = [f.path for f in entries if f.is_dir]
            if not level:
                return None
        return None

    def download_file(self, path: str, dst_dir: Path) -> Path:
        """Download the file at ``path`` into ``dst_dir`` (keeping its folders); its local path."""
        with mlflow_errors("download_artifacts", f"{self._what} file {path}"):
            return Path(self._repo.download_artifacts(path, dst_path=str(dst_dir)))

    def download_folder_files(self, folder: str, dst_dir: Path) -> Path:
        """Download the direct files of ``folder`` ("" for the root) into ``dst_dir`` (keeping
        its folders); the local folder holding them."""
        with mlflow_errors("list_artifacts", f"{self._what} folder {folder or '/'}"):
            items = self._repo.list_artifacts(folder or None)
        for item in items:
            if not item.is_dir:
                self.download_file(item.path, dst_dir)
        return dst_dir / folder if folder else dst_dir


class ModelArtifacts:
    """Registered model versions and their files (needs ``self.client`` and
    ``self.tracking_uri``)."""

    client: MlflowClient
    tracking_uri: str

    def resolve_model_version(self, uri: str) -> tuple[str, ModelVersion]:
        """``(name, ModelVersion)`` of ``models:/<name>@<alias>`` or ``models:/<name>/<version>``.

        Raises:
            MlflowModelSourceError: the URI has another form, or the registry has no such
                version (with MLflow's error code and message).
        """
        from mlflow.exceptions import MlflowException

        match = MODELS_URI.match(uri)
        if not match:
            raise MlflowModelSourceError(
                uri, "expected models:/<name>@<alias> or models:/<name>/<version>")
        name, alias, number = match.groups()
        try:
            version = (self.client.get_model_version_by_alias(name, alias) if alias
                       else self.client.get_model_version(name, number))
        except MlflowException as err:
            raise MlflowModelSourceError(uri, f"the registry has no such version "
                                              f"({err.error_code}: {err.message})") from err
        return name, version

    def model_version_files(self, version: ModelVersion) -> ModelVersionFiles:
        """The artifact files of ``version``: its LoggedModel's, or those of the run path (or
        other location) it was registered from.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        source = version.source or ""
        model_id = getattr(version, "model_id", None) or (
            source[len("models:/"):] if source.startswith("models:/m-") else None)
        what = f"model version {version.name} v{version.version}"
        if model_id:
            with mlflow_errors("get_logged_model", f"{what} model {model_id}"):
                location = self.client.get_logged_model(model_id).artifact_location
        elif source.startswith("runs:/"):
            run_id, _, path = source[len("runs:/"):].partition("/")
            with mlflow_errors("get_run", f"{what} run {run_id}"):
                location = self.client.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + path
        else:
            location = source
        with mlflow_errors("get_artifact_repository", f"{what} at {location}"):
            repository = get_artifact_repository(location, tracking_uri=self.tracking_uri)
        return ModelVersionFiles(repository, what)
