"""Data preparation: clean text files, split by document, train a byte-level BPE tokenizer,
write token shards and a manifest (docs/contracts.md, "Dataset"). Pure Python: no Airflow, no
MLflow; the ``prepare_data`` operator wraps :func:`prepare_dataset`.

The demo corpus fetcher lives in :mod:`operators.data.corpus`
(``python -m operators.data.corpus fetch --dest DIR``).
"""

from operators.data.errors import (
    CorpusFetchError,
    DataPrepError,
    DatasetInvalidError,
    EmptyCorpusError,
    InvalidSettingsError,
    SourceChangedError,
    SourceDecodeError,
    SourceNotFoundError,
)
from operators.data.settings import EOS_TOKEN, PrepareSettings

# numpy and tokenizers load only when these are first used, so that importing the settings
# and errors (e.g. at DAG-parse time) stays cheap (STYLE habit 13).
_LAZY = {
    "FORMAT": "operators.data.manifest",
    "load_manifest": "operators.data.manifest",
    "verify_dataset": "operators.data.manifest",
    "PreparedDataset": "operators.data.prepare",
    "prepare_dataset": "operators.data.prepare",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'operators.data' has no attribute {name!r}")

__all__ = [
    "EOS_TOKEN",
    "FORMAT",
    "CorpusFetchError",
    "DataPrepError",
    "DatasetInvalidError",
    "EmptyCorpusError",
    "InvalidSettingsError",
    "PrepareSettings",
    "PreparedDataset",
    "SourceChangedError",
    "SourceDecodeError",
    "SourceNotFoundError",
    "load_manifest",
    "prepare_dataset",
    "verify_dataset",
]
