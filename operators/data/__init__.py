"""Data preparation: stream text, JSONL or Parquet sources (local or S3, optionally gzip/zstd),
clean, deduplicate and split them by document, train (or reuse) a byte-level BPE tokenizer or
use a pretrained model's (:mod:`trainforge.data.model_tokenizer`), encode token shards in
parallel workers and write a manifest (docs/contracts.md, "Dataset"; docs/data.md). No Airflow, no MLflow; the ``prepare_data`` operator wraps :func:`prepare_dataset`.

The demo corpus fetcher lives in :mod:`trainforge.data.corpus`
(``python -m trainforge.data.corpus fetch --dest DIR``).
"""

import importlib

from trainforge.data.errors import (
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
from trainforge.data.settings import EOS_TOKEN, PrepareSettings

# numpy and tokenizers load only when these are first used, so that importing the settings
# and errors (e.g. at DAG-parse time) stays cheap.
_LAZY = {
    "FORMAT": "trainforge.data.manifest",
    "ModelEos": "trainforge.data.model_tokenizer",
    "load_manifest": "trainforge.data.manifest",
    "load_model_eos": "trainforge.data.model_tokenizer",
    "model_eos": "trainforge.data.model_tokenizer",
    "verify_dataset": "trainforge.data.manifest",
    "PreparedDataset": "trainforge.data.result",
    "prepare_dataset": "trainforge.data.prepare",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainforge.data' has no attribute {name!r}")

__all__ = [
    "EOS_TOKEN",
    "FORMAT",
    "CorpusFetchError",
    "DataPrepError",
    "DatasetInvalidError",
    "EmptyCorpusError",
    "InvalidSettingsError",
    "MalformedRecordError",
    "ModelEos",
    "PrepareSettings",
    "PreparedDataset",
    "SourceAccessError",
    "SourceChangedError",
    "SourceDecodeError",
    "SourceNotFoundError",
    "TokenizerSourceError",
    "load_manifest",
    "load_model_eos",
    "model_eos",
    "prepare_dataset",
    "verify_dataset",
]
