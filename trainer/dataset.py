"""A prepared dataset's manifest (docs/contracts.md, "Dataset"), read from a local folder and
checked against the files it lists: `read_dataset`. A document stream (text data) or an examples
dataset (chat data: each shard with a loss mask and example offsets beside it).

`trainforge.trainer.data.open_dataset` opens a dataset wherever it is (a folder, or an S3
prefix through this machine's cache) and is what the trainer calls.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainforge.contract import DATASET_FORMAT
from trainforge.contract import DATASET_MANIFEST as MANIFEST
from trainforge.storage.files import sha256_file
from trainforge.trainer.errors import DatasetError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
EXAMPLE_KINDS = ("chat", "prompt_completion")


@dataclass(frozen=True)
class Shard:
    path: Path
    bytes: int
    sha256: str
    tokens: int
    mask_path: Path | None = None  # examples datasets: one uint8 per token, 1 where it is a target
    offsets_path: Path | None = None  # examples datasets: count + 1 little-endian int64 offsets
    examples: int = 0  # examples datasets: the examples the shard holds


@dataclass(frozen=True)
class ExamplesInfo:
    """The manifest's ``examples`` object: the dataset holds whole rendered examples, not documents."""

    kind: str  # "chat" | "prompt_completion"
    chat_template_sha256: str
    sequence_length: int  # no example is longer (tokens)
    over_length: dict  # {"policy": "drop" | "truncate", "dropped": n, "truncated": n}
    pad_id: int  # what padding positions hold; padding is told apart by the mask, never by this id
    chat_template_path: Path | None = None  # the template the examples were rendered with (the export's)


@dataclass(frozen=True)
class Split:
    name: str
    documents: int
    tokens: int
    bytes_utf8: int  # UTF-8 bytes of the split's documents, as prepare_data counted them
    shards: tuple[Shard, ...]
    loss_tokens: int | None = None  # examples datasets: the mask's 1s


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
    examples: ExamplesInfo | None = None  # None: a document stream (text data)


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
    ``validation`` split. An examples dataset (a top-level ``examples`` object) also: each
    shard's ``loss_mask`` and ``examples`` files (`_read_examples_shard`).

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

    examples = _examples_info(manifest, where, vocab_size, root, verify_hashes) if "examples" in manifest else None
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
            if examples is not None:
                shard = _read_examples_shard(root, shard, sh, shw, examples.sequence_length, verify_hashes)
            shards.append(shard)
        split = Split(name, _field(sp, "documents", int, sw), _field(sp, "tokens", int, sw),
                      _field(sp, "bytes_utf8", int, sw), tuple(shards),
                      _field(sp, "loss_tokens", int, sw) if examples is not None else None)
        if split.tokens != sum(s.tokens for s in shards):
            raise DatasetError(f"{sw}: tokens={split.tokens} but its shards hold "
                               f"{sum(s.tokens for s in shards)}")
        if examples is not None and split.documents != sum(s.examples for s in shards):
            raise DatasetError(f"{sw}: documents={split.documents} but its shards hold "
                               f"{sum(s.examples for s in shards)} examples")
        if examples is not None and verify_hashes:
            ones = sum(int(np.count_nonzero(np.memmap(s.mask_path, np.uint8, "r"))) for s in shards if s.tokens)
            if ones != split.loss_tokens:
                raise DatasetError(f"{sw}: loss_tokens={split.loss_tokens} but its loss masks hold {ones} ones")
        splits[name] = split
    for needed in ("train", "validation"):
        if needed not in splits or splits[needed].tokens < 2:
            raise DatasetError(f"{where}: split {needed!r} is missing or has fewer than 2 tokens")
    return Dataset(root, _field(manifest, "digest", str, where), dtype, vocab_size,
                   _field(manifest, "eos_token", str, where), eos_id, tokenizer_path,
                   tok["sha256"], splits, examples)


def _examples_info(manifest: dict, where: str, vocab_size: int, root: Path, verify_hashes: bool) -> ExamplesInfo:
    """The manifest's ``examples`` object, checked."""
    ew = f"{where} examples"
    obj = _field(manifest, "examples", dict, where)
    kind = _field(obj, "kind", str, ew)
    if kind not in EXAMPLE_KINDS:
        raise DatasetError(f"{ew}: kind={kind!r}, expected one of {list(EXAMPLE_KINDS)}")
    sequence_length = _field(obj, "sequence_length", int, ew)
    if sequence_length < 2:
        raise DatasetError(f"{ew}: sequence_length={sequence_length}, expected at least 2 tokens")
    pad_id = _field(obj, "pad_id", int, ew)
    if not 0 <= pad_id < vocab_size:
        raise DatasetError(f"{ew}: pad_id={pad_id}, expected 0 <= pad_id < vocab_size={vocab_size}")
    template = None
    if "chat_template" in obj:  # datasets prepared before it was kept have only the hash
        tw = f"{ew}.chat_template"
        entry = _field(obj, "chat_template", dict, ew)
        template = _file_in(root, _field(entry, "file", str, tw), tw)
        _check_file(template, _field(entry, "bytes", int, tw), _field(entry, "sha256", str, tw), verify_hashes)
    return ExamplesInfo(kind, _field(obj, "chat_template_sha256", str, ew), sequence_length,
                        dict(_field(obj, "over_length", dict, ew)), pad_id, template)


def _read_examples_shard(root: Path, shard: Shard, entry: dict, where: str, sequence_length: int,
                         verify_hashes: bool) -> Shard:
    """``shard`` with its loss mask and example offsets, checked: sizes (and, when
    ``verify_hashes``, SHA-256 and mask values 0/1); offsets from 0 rising to the shard's tokens,
    no example longer than ``sequence_length``.

    Raises:
        DatasetError: naming the file and what is wrong with it.
    """
    mw, ow = f"{where}.loss_mask", f"{where}.examples"
    mask, offsets = _field(entry, "loss_mask", dict, where), _field(entry, "examples", dict, where)
    mask_path = _file_in(root, _field(mask, "file", str, mw), mw)
    offsets_path = _file_in(root, _field(offsets, "file", str, ow), ow)
    count = _field(offsets, "count", int, ow)
    if _field(mask, "bytes", int, mw) != shard.tokens:
        raise DatasetError(f"{mw}: bytes={mask['bytes']} but the shard has tokens={shard.tokens} (one uint8 each)")
    if count < 0 or _field(offsets, "bytes", int, ow) != (count + 1) * 8:
        raise DatasetError(f"{ow}: bytes={offsets['bytes']} but count={count} needs (count + 1) x 8 = "
                           f"{(count + 1) * 8} bytes of int64 offsets")
    _check_file(mask_path, mask["bytes"], _field(mask, "sha256", str, mw), verify_hashes)
    _check_file(offsets_path, offsets["bytes"], _field(offsets, "sha256", str, ow), verify_hashes)
    if verify_hashes and shard.tokens:
        top = int(np.memmap(mask_path, np.uint8, "r").max())
        if top > 1:
            raise DatasetError(f"{mask_path}: holds the value {top}; a loss mask holds only 0 and 1")
    bounds = np.fromfile(offsets_path, dtype="<i8")  # (count + 1,)
    lengths = np.diff(bounds)
    if bounds[0] != 0 or bounds[-1] != shard.tokens or (lengths <= 0).any():
        raise DatasetError(f"{offsets_path}: offsets must rise from 0 to the shard's tokens={shard.tokens}; "
                           f"they go from {bounds[0]} to {bounds[-1]}"
                           + (f", example {int(np.argmax(lengths <= 0))} is empty or negative"
                              if (lengths <= 0).any() else ""))
    if count and (longest := int(lengths.max())) > sequence_length:
        raise DatasetError(f"{offsets_path}: example {int(lengths.argmax())} has {longest} tokens, more than "
                           f"examples.sequence_length={sequence_length}")
    return dataclasses.replace(shard, mask_path=mask_path, offsets_path=offsets_path, examples=count)


def _check_file(path: Path, size: int, sha256: str, verify_hash: bool) -> None:
    try:
        actual = path.stat().st_size
    except OSError as err:
        raise DatasetError(f"{path}: listed in the dataset manifest but missing ({err.strerror})") from err
    if actual != size:
        raise DatasetError(f"{path}: {actual} bytes on disk, manifest says {size}")
    if verify_hash and (got := sha256_file(path)) != sha256:
        raise DatasetError(f"{path}: SHA-256 {got} does not match the manifest's {sha256}")
