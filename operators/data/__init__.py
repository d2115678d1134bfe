"""Data preparation: stream text, JSONL or Parquet sources (local or S3, optionally gzip/zstd),
clean, deduplicate and split them by document, train (or reuse) a byte-level BPE tokenizer,
encode token shards in parallel workers and write a manifest (docs/contracts.md, "Dataset";
docs/data.md). No Airflow, no MLflow; the ``prepare_data`` operator wraps :func:`prepare_dataset`.

The demo corpus fetcher lives in :mod:`operators.data.corpus`
(``python -m operators.data.corpus fetch --dest DIR``).
"""

from operators.data.errors import (
    CorpusFetchError,
    DataPrepError,
    DatasetInvalidError,
    EmptyCorpusError,
    InvalidSettingsError,
    MalformedRecordError,
    SourceAccessError,
    SourceChangedError,
    SourceDecodeError,
    SourceNotFoundError,
    TokenizerSourceError,
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
    "MalformedRecordError",
    "PrepareSettings",
    "PreparedDataset",
    "SourceAccessError",
    "SourceChangedError",
    "SourceDecodeError",
    "SourceNotFoundError",
    "TokenizerSourceError",
    "load_manifest",
    "prepare_dataset",
    "verify_dataset",
]
