"""Resolve ``model.pretrained`` into a folder the job's ranks read (docs/contracts.md).

:func:`resolve_pretrained` is the Airflow side's one resolver of a model source; the result is
the job config's ``pretrained`` section (``folder``, ``source``, ``revision``):

* a local folder (absolute, or relative to ``home``): as it is;
* ``s3://bucket/prefix/``: as it is, read by the ranks through trainforge.storage;
* ``models:/<name>@<alias>`` or ``models:/<name>/<version>``: the alias resolved once; the
  version's Hugging Face folder found by its ``config.json`` (sharded or not); its ``s3://``
  URI with an S3 artifact store, else a copy in ``<home>/models/<name>/<version>/``;
* ``hf://<org>/<name>[@<revision>]``: huggingface_hub's snapshot in the deployment's cache
  (``HF_HOME``; with ``HF_HUB_OFFLINE=1`` the cache only); the revision is its commit hash.

Each must hold ``config.json``. A source that cannot be used raises
:class:`PretrainedSourceError` (permanent: no retry helps); a store or Hub that cannot be
reached raises its own error, which a retry may get past. The Hub token: ``hf_token``, else the
password of Airflow connection ``hf_conn_id``, else huggingface_hub's own (``HF_TOKEN``);
never the spec.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.errors import TrainforgeError
from trainforge.paths import safe_segment
from trainforge.pipeline.architecture import HF_URI
from trainforge.pipeline.engines import needs_s3

#: The file that marks a Hugging Face model folder (the architecture of its weights).
CONFIG_FILE = "config.json"
#: Folders searched below a model version's artifact root for :data:`CONFIG_FILE`.
SEARCH_DEPTH = 4
#: What an ``hf://`` snapshot fetches: config, weights, tokenizer, chat template, licence.
HF_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "README.md", "LICENSE*"]
_COMMIT = re.compile(r"^[0-9a-f]{40}$")

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

    from trainforge.hooks.mlflow import MlflowHook


class PretrainedSourceError(TrainforgeError):
    """A model source that cannot be used: no such version or Hub model, no ``config.json``, a
    gated model without access, a name not in an offline cache. Permanent."""

    def __init__(self, uri: str, reason: str, field: str = "model.pretrained") -> None:
        super().__init__(f"{field} {uri}: {reason}")
        self.uri, self.reason, self.field = uri, reason, field


@dataclass(frozen=True)
class ResolvedModel:
    """A resolved model source: ``folder`` (an absolute local folder, or an ``s3://`` prefix
    without a trailing '/') holds config.json, the weights and the tokenizer."""

    source: str
    folder: str
    revision: str | None

    def job_section(self) -> dict[str, str | None]:
        """The job config's ``pretrained`` section."""
        return {"folder": self.folder, "source": self.source, "revision": self.revision}


def registered_version(hook: MlflowHook, uri: str, field: str = "model.pretrained"
                       ) -> tuple[str, ModelVersion, str]:
    """``(name, ModelVersion, "models:/<name>/<version>")`` of a registered model URI; an alias is
    resolved here, once. Raises PretrainedSourceError when the registry has no such version."""
    from trainforge.hooks.errors import MlflowModelSourceError

    try:
        name, version = hook.resolve_model_version(uri)
    except MlflowModelSourceError as err:
        raise PretrainedSourceError(uri, err.reason, field) from err
    return name, version, f"models:/{name}/{version.version}"


def registered_folder(hook: MlflowHook, uri: str, name: str, version: ModelVersion, engine: str,
                      dest_root: Path, field: str = "model.pretrained") -> str:
    """The Hugging Face folder of a registered model version, where the ranks read it.

    The shallowest folder holding :data:`CONFIG_FILE` in the version's artifacts: its ``s3://``
    URI with an S3 artifact store; else its files (all shards) downloaded once into
    ``<dest_root>/<name>/<version>/`` (versions are immutable), which an engine without this
    machine's disk (``needs_s3``) cannot read: then PretrainedSourceError.
    """
    resolved = f"models:/{name}/{version.version}"
    files = hook.model_version_files(version)
    found = files.find(CONFIG_FILE, SEARCH_DEPTH)
    if found is None:
        raise PretrainedSourceError(uri, f"{resolved} has no {CONFIG_FILE} in its artifacts "
                                         f"(searched {SEARCH_DEPTH} folders deep)", field)
    folder = found.rpartition("/")[0]
    root = files.root_uri
    if root.startswith("s3://"):
        return root.rstrip("/") + (f"/{folder}" if folder else "")
    if needs_s3(engine):
        raise PretrainedSourceError(uri, f"the {engine} engine reads initial weights from S3, but "
                                         f"{resolved} is stored at {root or 'a non-S3 location'}: "
                                         f"use an s3:// artifact store for the MLflow server",
                                    field)
    dest = dest_root / safe_segment(name) / str(version.version)
    if not (dest / CONFIG_FILE).is_file():
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:  # the folder's direct files: config, every shard and its index, tokenizer files
            downloaded = files.download_folder_files(folder, tmp)
            shutil.rmtree(dest, ignore_errors=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(downloaded, dest)  # atomic: a reader sees the whole folder or none
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dest.resolve())


def resolve_pretrained(uri: str, *, engine: str, home: Path,
                       mlflow_hook: MlflowHook | None = None, hf_token: str | None = None,
                       s3_client: Any = None, hf_conn_id: str | None = None) -> ResolvedModel:
    """Resolve ``model.pretrained`` (see the module doc) for a job on ``engine``.

    Args:
        home: TRAINFORGE_HOME: relative folders resolve against it, models:/ copies go under
            ``<home>/models/``.
        mlflow_hook: the MlflowHook of the registry (models:/ only).
        hf_token, hf_conn_id: the Hub token (hf:// only), or the Airflow connection whose
            password it is; neither: huggingface_hub's own (HF_TOKEN, its token file).
        s3_client: the boto3 S3 client for an s3:// source (an Airflow connection's); default:
            this process's, on boto3's standard chain.

    Raises:
        PretrainedSourceError: the source cannot be used (the message names URI and file).
        StorageError, MlflowRequestError, huggingface_hub's connection errors: a store, the
            registry or the Hub could not be reached.
    """
    if uri.startswith("hf://"):
        token = hf_token or (connection_token(hf_conn_id) if hf_conn_id else None)
        resolved = _from_hub(uri, token)
    elif uri.startswith("models:/"):
        if mlflow_hook is None:
            raise PretrainedSourceError(uri, "a registered model needs the MLflow registry "
                                             "(no MLflow hook was given)")
        name, version, revision = registered_version(mlflow_hook, uri)
        folder = registered_folder(mlflow_hook, uri, name, version, engine, home / "models")
        resolved = ResolvedModel(uri, folder, revision)
    elif uri.startswith("s3://"):
        resolved = ResolvedModel(uri, uri.rstrip("/"), None)
    else:
        path = Path(uri).expanduser()
        resolved = ResolvedModel(uri, str((path if path.is_absolute() else home / path)
                                          .absolute()), None)
    check_folder(resolved, engine, s3_client)
    return resolved


def check_folder(resolved: ResolvedModel, engine: str, s3_client: Any = None) -> None:
    """Raise PretrainedSourceError unless ``resolved.folder`` holds config.json where the ranks
    of a job on ``engine`` can read it."""
    from trainforge.storage import storage_for

    folder = resolved.folder
    _check_engine(resolved, engine)
    storage = storage_for(folder, (lambda: s3_client) if s3_client is not None else None)
    config = storage.join(folder, CONFIG_FILE)
    if storage.size(config) is None:
        where = "" if resolved.source == folder else f" ({resolved.source} resolved to {folder})"
        raise PretrainedSourceError(resolved.source, f"{storage.absolute(config)} does not "
                                    f"exist{where}: expected a Hugging Face model folder "
                                    f"(config.json, *.safetensors, tokenizer.json)"
                                    f"{_hub_hint(resolved.source, folder)}")


def _hub_hint(source: str, folder: str) -> str:
    """For a missing relative ``org/name`` folder: how to name that model on the Hub."""
    parts = source.split("/")
    if (len(parts) == 2 and all(parts) and "://" not in source and not source.startswith(("~", "."))
            and not Path(folder).parent.is_dir()):
        return f"; for the Hugging Face Hub's {source}, write hf://{source}"
    return ""


def _check_engine(resolved: ResolvedModel, engine: str) -> None:
    if not resolved.folder.startswith("s3://") and needs_s3(engine):
        raise PretrainedSourceError(resolved.source, f"the {engine} engine's ranks cannot read "
                                    f"{resolved.folder} on this machine: copy the folder to S3 "
                                    f"and give model.pretrained as its s3:// prefix")


def pretrained_section(uri: str, prepared: Mapping[str, Any] | None, **resolve: Any
                       ) -> dict[str, str | None]:
    """The job config's ``pretrained`` section for ``uri``: the one ``prepare_data`` resolved
    (its XCom ``pretrained``: an alias or branch that moved since cannot change the model),
    else resolved now with ``resolve`` (:func:`resolve_pretrained`'s keywords)."""
    given = (prepared or {}).get("pretrained")
    if isinstance(given, Mapping) and given.get("source") == uri and given.get("folder"):
        section = ResolvedModel(uri, str(given["folder"]), given.get("revision"))
        _check_engine(section, resolve["engine"])  # a stage may run on another engine
        return section.job_section()
    return resolve_pretrained(uri, **resolve).job_section()


def connection_token(conn_id: str) -> str:
    """The Hugging Face token kept as the password of Airflow connection ``conn_id``."""
    from airflow.sdk import BaseHook

    try:
        password = BaseHook.get_connection(conn_id).password
    except Exception as err:  # noqa: BLE001 - Airflow raises several types for "not found"
        raise PretrainedSourceError(conn_id, f"the Airflow connection could not be read "
                                    f"({type(err).__name__}: {err}); expected a connection whose "
                                    f"password is a Hugging Face token",
                                    "Hugging Face connection") from err
    if not password:
        raise PretrainedSourceError(conn_id, "the Airflow connection has no password (expected "
                                    "a Hugging Face token there)", "Hugging Face connection")
    return password


def _hub_settings() -> tuple[str | None, bool]:
    """(cache folder or None for huggingface_hub's default, offline?), read from the
    environment now: a long-lived worker may have imported huggingface_hub before either was set."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    offline = (value.strip().upper() in {"1", "ON", "YES", "TRUE"} if value is not None
               else bool(constants.HF_HUB_OFFLINE))
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"]), offline
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub"), offline
    return None, offline


def _from_hub(uri: str, token: str | None) -> ResolvedModel:
    """An ``hf://`` model's snapshot folder and commit hash (see the module doc)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hub

    match = HF_URI.match(uri)
    if match is None:
        raise PretrainedSourceError(uri, "expected hf://<org>/<name>[@<revision>]")
    repo, revision = match["repo"], match["revision"]
    cache, offline = _hub_settings()
    at = f"{repo}@{revision or 'main'}"
    where = f"the Hugging Face cache {cache or '(huggingface_hub default)'}"
    try:
        folder = snapshot_download(repo, revision=revision, cache_dir=cache, token=token,
                                   local_files_only=offline, allow_patterns=HF_FILES)
    except hub.IncompleteSnapshotError as err:
        raise PretrainedSourceError(uri, f"{where} holds an incomplete snapshot of {at} "
                                    f"({err}); download it again where the Hub is reachable "
                                    f"(hf download {repo})") from err
    except hub.LocalEntryNotFoundError as err:
        if not offline:
            raise  # the Hub could not be reached: a retry may succeed
        command = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
        # from None: the Hub's own advice (pass local_files_only=False) is not a trainforge user's
        raise PretrainedSourceError(uri, f"{at} is not in {where} and HF_HUB_OFFLINE=1 forbids "
                                    f"downloading it: download it where the Hub is reachable "
                                    f"({command} with the same HF_HOME), or give "
                                    f"model.pretrained as a local copy of the folder") from None
    except hub.GatedRepoError as err:
        raise PretrainedSourceError(uri, f"{repo} is gated: accept its licence on "
                                    f"https://huggingface.co/{repo} with the account whose token "
                                    f"the deployment uses (HF_TOKEN or the Airflow connection)"
                                    ) from err
    except hub.RepositoryNotFoundError as err:
        raise PretrainedSourceError(uri, f"the Hub has no model {repo}, or it is private and the "
                                    f"deployment's token (HF_TOKEN or the Airflow connection) "
                                    f"cannot see it; check the name") from err
    except hub.RevisionNotFoundError as err:
        raise PretrainedSourceError(uri, f"{repo} has no revision {revision!r} (expected one of "
                                    f"its branches, tags or commit hashes)") from err
    except hub.HfHubHTTPError as err:
        if getattr(err.response, "status_code", None) != 401:
            raise  # the Hub failed: a retry may succeed
        raise PretrainedSourceError(uri, f"the Hub refused the token for {repo} (HTTP 401); give "
                                    f"a valid one as HF_TOKEN or the Airflow connection") from err
    except hub.HFValidationError as err:
        raise PretrainedSourceError(uri, f"not a Hub model id: {err}") from err
    commit = Path(folder).name
    return ResolvedModel(uri, str(Path(folder).absolute()),
                         commit if _COMMIT.match(commit) else revision)
