"""A prepared dataset's manifest (docs/contracts.md, "Dataset"), read from a local folder and
checked against the files it lists: `read_dataset`.

`trainforge.trainer.data.open_dataset` opens a dataset wherever it is (a folder, or an S3
prefix through this machine's cache) and is what the trainer calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainforge.storage.files import sha256_file
from trainforge.trainer.errors import DatasetError

DATASET_FORMAT = "trainforge.dataset/v1"
MANIFEST = "manifest.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class Shard:
    path: Path
    bytes: int
    sha256: str
    tokens: int


@dataclass(frozen=True)
class Split:
    name: str
    documents: int
    tokens: int
    bytes_utf8: int  # UTF-8 bytes of the split's documents, as prepare_data counted them
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class Dataset:
    """A dataset folder whose manifest.json was read and checked."""

    dir: Path
    digest: str
    dtype: str  # "uint16" | "uint32"
    vocab_size: int
    eos_token: str
    eos_id: int
    tokenizer_path: Path
    tokenizer_sha256: str
    splits: dict[str, Split]


def _field(obj: dict, key: str, kind: type, where: str):
    """``obj[key]`` when it is a ``kind`` (bools are not ints), else DatasetError."""
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise DatasetError(f"{where}: field {key!r}={value!r} is missing or not a JSON {kind.__name__}")
    return value


def _file_in(root: Path, name: str, where: str) -> Path:
    """``root / name`` for a plain file name (no folders, no ``..``), else DatasetError."""
    if Path(name).name != name or name in (".", ".."):
        raise DatasetError(f"{where}: file {name!r} must be a plain file name inside {root}")
    return root / name


def read_dataset(dataset_dir: str | Path, verify_hashes: bool = True) -> Dataset:
    """Read the local folder's ``manifest.json`` and check the files it lists.

    Checks: format, dtype, vocab/eos ranges, tokenizer and every shard present with the listed
    size (and, when ``verify_hashes``, SHA-256 and every token id < vocab_size), shard bytes =
    tokens x itemsize, split token counts = sum of their shards, a ``train`` and a
    ``validation`` split.

    Raises:
        DatasetError: any of the above fails (exit code 78: the dataset does not exist).
    """
    root = Path(dataset_dir)
    manifest_path = root / MANIFEST
    where = str(manifest_path)
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(f"{where}: missing; a dataset folder without a manifest does not exist") from None
    except (OSError, ValueError) as err:
        raise DatasetError(f"{where}: unreadable ({err})") from err
    if _field(manifest, "format", str, where) != DATASET_FORMAT:
        raise DatasetError(f"{where}: format={manifest['format']!r}, expected {DATASET_FORMAT!r}")
    dtype = _field(manifest, "dtype", str, where)
    if dtype not in DTYPES:
        raise DatasetError(f"{where}: dtype={dtype!r}, expected one of {sorted(DTYPES)}")
    vocab_size = _field(manifest, "vocab_size", int, where)
    if not 1 <= vocab_size <= np.iinfo(DTYPES[dtype]).max + 1:
        raise DatasetError(f"{where}: vocab_size={vocab_size} does not fit dtype {dtype}")
    eos_id = _field(manifest, "eos_id", int, where)
    if not 0 <= eos_id < vocab_size:
        raise DatasetError(f"{where}: eos_id={eos_id}, expected 0 <= eos_id < vocab_size={vocab_size}")

    tok = _field(manifest, "tokenizer", dict, where)
    tokenizer_path = _file_in(root, _field(tok, "file", str, f"{where} tokenizer"), f"{where} tokenizer")
    _check_file(tokenizer_path, _field(tok, "bytes", int, f"{where} tokenizer"),
                _field(tok, "sha256", str, f"{where} tokenizer"), verify_hashes)

    itemsize = np.dtype(DTYPES[dtype]).itemsize
    splits = {}
    for name, sp in _field(manifest, "splits", dict, where).items():
        sw = f"{where} splits.{name}"
        shards = []
        for i, sh in enumerate(_field(sp, "shards", list, sw)):
            shw = f"{sw}.shards[{i}]"
            shard = Shard(_file_in(root, _field(sh, "file", str, shw), shw), _field(sh, "bytes", int, shw),
                          _field(sh, "sha256", str, shw), _field(sh, "tokens", int, shw))
            if shard.bytes != shard.tokens * itemsize:
                raise DatasetError(f"{shw}: bytes={shard.bytes} but tokens={shard.tokens} x {itemsize} "
                                   f"bytes ({dtype}) = {shard.tokens * itemsize}")
            _check_file(shard.path, shard.bytes, shard.sha256, verify_hashes)
            top = int(np.memmap(shard.path, DTYPES[dtype], "r").max()) if verify_hashes and shard.tokens else 0
            if top >= vocab_size:
                raise DatasetError(f"{shard.path}: holds token id {top}, outside vocab_size={vocab_size}")
            shards.append(shard)
        split = Split(name, _field(sp, "documents", int, sw), _field(sp, "tokens", int, sw),
                      _field(sp, "bytes_utf8", int, sw), tuple(shards))
        if split.tokens != sum(s.tokens for s in shards):
            raise DatasetError(f"{sw}: tokens={split.tokens} but its shards hold "
                               f"{sum(s.tokens for s in shards)}")
        splits[name] = split
    for needed in ("train", "validation"):
        if needed not in splits or splits[needed].tokens < 2:
            raise DatasetError(f"{where}: split {needed!r} is missing or has fewer than 2 tokens")
    return Dataset(root, _field(manifest, "digest", str, where), dtype, vocab_size,
                   _field(manifest, "eos_token", str, where), eos_id, tokenizer_path,
                   tok["sha256"], splits)


def _check_file(path: Path, size: int, sha256: str, verify_hash: bool) -> None:
    try:
        actual = path.stat().st_size
    except OSError as err:
        raise DatasetError(f"{path}: listed in the dataset manifest but missing ({err.strerror})") from err
    if actual != size:
        raise DatasetError(f"{path}: {actual} bytes on disk, manifest says {size}")
    if verify_hash and (got := sha256_file(path)) != sha256:
        raise DatasetError(f"{path}: SHA-256 {got} does not match the manifest's {sha256}")
