"""Resolve ``model.init_from`` (a registered model) into the job config's ``init`` section.

The ``train`` task calls :func:`registered_init` before it launches: the registry alias or
version is resolved once (``models:/name@champion`` -> ``models:/name/7``), the version's
Hugging Face model folder (the one holding ``config.json``, sharded or not) is located in its
artifacts, and the trainer is handed that folder (trainforge.model_source, which resolves
``model.pretrained``'s registered models the same way):

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

from pathlib import Path

from trainforge.hooks.mlflow import MlflowHook
from trainforge.model_source import PretrainedSourceError, registered_folder, registered_version


class InitSourceError(PretrainedSourceError):
    """``model.init_from`` cannot be used: no such version, no weights, or another tokenizer."""

    def __init__(self, uri: str, reason: str) -> None:
        super().__init__(uri, reason, "model.init_from")


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
        InitSourceError: the version does not exist, has no Hugging Face folder (``config.json``)
            in its artifacts, the data was encoded with another version's tokenizer, or the
            engine cannot read the weights.
        MlflowRequestError: the server or the artifact store failed a call.
    """
    try:
        name, version, resolved = registered_version(hook, uri, "model.init_from")
        if tokenizer_source != resolved:
            raise InitSourceError(uri, f"resolves to {resolved}, but the data was encoded with "
                                       f"the tokenizer of "
                                       f"{tokenizer_source or 'a newly trained tokenizer'} (an "
                                       f"alias moved between the tasks?); run the pipeline again")
        folder = registered_folder(hook, uri, name, version, engine, dest_root, "model.init_from")
    except InitSourceError:
        raise
    except PretrainedSourceError as err:
        raise InitSourceError(uri, err.reason) from err
    return {"checkpoint": folder, "source": resolved}
