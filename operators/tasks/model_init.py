"""Resolve ``model.init_from`` (a registered model) into the job config's ``init`` section.

The ``train`` task calls :func:`registered_init` before it launches: the registry alias or
version is resolved once (``models:/name@champion`` -> ``models:/name/7``), the version's
Hugging Face model folder is located in its artifacts, and the trainer is handed that folder:

* an ``s3://`` artifact store: the folder's URI, which every engine's ranks read directly;
* any other store (local, or proxied through the MLflow server): a local copy under
  ``TRAINFORGE_HOME/models/<name>/<version>/`` (versions are immutable, so one download serves
  every run), which the local engine, and a Ray head on the same machine, can read. An engine
  whose jobs do not share this machine's disk (kubernetes) needs the S3 form.

The tokenizer must be the one the data was encoded with: the prepare task resolved
``data.tokenizer.source`` (the spec requires the same URI) to a version too, and the two must be
the same version; the trainer checks the vocabulary again when it loads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainforge.errors import TrainforgeError
from trainforge.hooks.errors import MlflowModelSourceError
from trainforge.hooks.mlflow import MlflowHook
from trainforge.paths import safe_segment
from trainforge.pipeline.engines import needs_s3
#: The file that marks a model version's Hugging Face folder in its artifacts.
WEIGHTS_FILE = "model.safetensors"
#: Folders searched below a model version's artifact root for :data:`WEIGHTS_FILE`.
WEIGHTS_SEARCH_DEPTH = 4


class InitSourceError(TrainforgeError):
    """``model.init_from`` cannot be used: no such version, no weights, or another tokenizer."""

    def __init__(self, uri: str, reason: str) -> None:
        super().__init__(f"model.init_from {uri}: {reason}")
        self.uri, self.reason = uri, reason


def registered_init(hook: MlflowHook, uri: str, engine: str, dest_root: Path,
                    tokenizer_source: str | None) -> dict[str, str]:
    """The job config's ``init`` block for registered model ``uri``.

    Args:
        hook: the MLflow hook of the tracking server (it serves the registry too).
        uri: ``models:/<name>@<alias>`` or ``models:/<name>/<version>``.
        engine: ``training.engine``; an engine without a shared disk (kubernetes) requires an
            ``s3://`` artifact store.
        dest_root: where local copies go (``<dest_root>/<name>/<version>/``).
        tokenizer_source: the ``models:/<name>/<version>`` the prepare task took the tokenizer
            from (its XCom ``tokenizer_source``).

    Returns:
        ``{"checkpoint": folder or s3:// URI, "source": "models:/<name>/<version>"}``.

    Raises:
        InitSourceError: the version does not exist, has no ``model.safetensors``, the data was
            encoded with another version's tokenizer, or the engine cannot read the weights.
        MlflowRequestError: the server or the artifact store failed a call.
    """
    try:
        name, version = hook.resolve_model_version(uri)
    except MlflowModelSourceError as err:
        raise InitSourceError(uri, err.reason) from err
    resolved = f"models:/{name}/{version.version}"
    if tokenizer_source != resolved:
        raise InitSourceError(uri, f"resolves to {resolved}, but the data was encoded with the "
                                   f"tokenizer of {tokenizer_source or 'a newly trained tokenizer'} "
                                   f"(an alias moved between the tasks?); run the pipeline again")
    files = hook.model_version_files(version)
    found = files.find(WEIGHTS_FILE, WEIGHTS_SEARCH_DEPTH)
    if found is None:
        raise InitSourceError(uri, f"{resolved} has no {WEIGHTS_FILE} in its artifacts")
    folder = found.rpartition("/")[0]
    root = files.root_uri
    if root.startswith("s3://"):
        location = root.rstrip("/") + (f"/{folder}" if folder else "")
        return {"checkpoint": location, "source": resolved}
    if needs_s3(engine):
        raise InitSourceError(uri, f"the {engine} engine reads initial weights from S3, but "
                                   f"{resolved} is stored at {root or 'a non-S3 location'}: use an "
                                   f"s3:// artifact store for the MLflow server")
    dest = dest_root / safe_segment(name) / str(version.version)
    if not (dest / WEIGHTS_FILE).is_file():
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            # the folder's direct files: config.json, model.safetensors, tokenizer files
            downloaded = files.download_folder_files(folder, tmp)
            shutil.rmtree(dest, ignore_errors=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(downloaded, dest)  # atomic: a reader sees the whole folder or none
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"checkpoint": str(dest.resolve()), "source": resolved}
