"""Prepared datasets (docs/contracts.md, "Dataset"): manifest checks, token streams, batches.

Sampling is a pure function of ``(seed, step)``, so a resumed run sees exactly the batches an
uninterrupted one would, with no dataloader state to save:

    rng     = numpy Generator(PCG64(SeedSequence([seed, step])))
    starts  = rng.integers(0, N - T, size=global_batch)      # N train tokens, T = seq_len
    rank r  takes starts[r*A*m : (r+1)*A*m], A = accumulation steps, m = micro batch
    micro-step a takes the a-th block of m starts of that slice
    x = tokens[s : s+T], y = tokens[s+1 : s+T+1]             # (m, T) int64 each

Which rank reads which sequence depends on the world size, the global batch of a step does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainforge.trainer.errors import DatasetError
from trainforge.trainer.fsutil import sha256_file

DATASET_FORMAT = "trainforge.dataset/v1"
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


def open_dataset(dataset_dir: str | Path, verify_hashes: bool = True) -> Dataset:
    """Read ``dataset_dir/manifest.json`` and check the files it lists.

    Checks: format, dtype, vocab/eos ranges, tokenizer and every shard present with the listed
    size (and, when ``verify_hashes``, SHA-256 and every token id < vocab_size), shard bytes =
    tokens x itemsize, split token counts = sum of their shards, a ``train`` and a
    ``validation`` split.

    An ``s3://bucket/prefix/<digest>`` URI is read through this machine's cache (trainforge.trainer.data_s3:
    downloaded once, verified, renamed into place); ``Dataset.dir`` is then the local copy.

    Raises:
        DatasetError: any of the above fails (exit code 78: the dataset does not exist).
        S3Error: an ``s3://`` dataset could not be read after retries (transient).
    """
    if isinstance(dataset_dir, str) and dataset_dir.startswith("s3://"):
        from trainforge.trainer.data_s3 import cached_dataset

        return cached_dataset(dataset_dir, verify_hashes)
    root = Path(dataset_dir)
    manifest_path = root / "manifest.json"
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


class TokenStream:
    """The shards of one split as one read-only stream of token ids (memory-mapped)."""

    def __init__(self, dataset: Dataset, split: str) -> None:
        np_dtype = DTYPES[dataset.dtype]
        self.shards = [np.memmap(s.path, dtype=np_dtype, mode="r") for s in dataset.splits[split].shards
                       if s.tokens > 0]
        self.starts = np.cumsum([0] + [len(m) for m in self.shards])  # (n_shards + 1,)
        self.num_tokens = int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` across shard boundaries: (length,) int64."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"read [{start}, {start + length}) outside a stream of {self.num_tokens} tokens")
        out = np.empty(length, dtype=np.int64)
        filled = 0
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            lo = start + filled - int(self.starts[i])
            take = min(length - filled, len(self.shards[i]) - lo)
            out[filled:filled + take] = self.shards[i][lo:lo + take]
            filled += take
            i += 1
        return out

    def iter_chunks(self, chunk_tokens: int = 1 << 22) -> Iterator[np.ndarray]:
        """The whole stream in order, as arrays of at most ``chunk_tokens`` tokens."""
        for m in self.shards:
            for lo in range(0, len(m), chunk_tokens):
                yield np.asarray(m[lo:lo + chunk_tokens])


class BatchSampler:
    """Deterministic training batches: see the module docstring for the exact recipe.

    Raises:
        DatasetError: the train split is shorter than ``seq_len + 1`` tokens.
    """

    def __init__(self, stream: TokenStream, seq_len: int, micro_batch: int, accum_steps: int,
                 world_size: int, seed: int) -> None:
        if stream.num_tokens < seq_len + 1:
            raise DatasetError(f"train split has {stream.num_tokens} tokens, fewer than "
                               f"data.sequence_length + 1 = {seq_len + 1}")
        self.stream, self.seq_len, self.micro_batch = stream, seq_len, micro_batch
        self.accum_steps, self.world_size, self.seed = accum_steps, world_size, seed
        self.global_batch = micro_batch * accum_steps * world_size

    def starts(self, step: int) -> np.ndarray:
        """Start offsets of all sequences of optimizer step ``step``: (global_batch,) int64."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, step])))
        return rng.integers(0, self.stream.num_tokens - self.seq_len, size=self.global_batch, dtype=np.int64)

    def micro_batches(self, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's ``accum_steps`` micro-batches of step ``step``: [(x, y)], each (m, T) int64."""
        per_rank = self.micro_batch * self.accum_steps
        mine = self.starts(step)[rank * per_rank:(rank + 1) * per_rank]
        out = []
        for a in range(self.accum_steps):
            block = mine[a * self.micro_batch:(a + 1) * self.micro_batch]
            rows = np.stack([self.stream.read(int(s), self.seq_len + 1) for s in block])  # (m, T+1)
            xy = torch.from_numpy(rows)
            out.append((xy[:, :-1], xy[:, 1:]))  # x, y: (m, T) int64, y = x shifted left by one
        return out


def validation_windows(stream: TokenStream, seq_len: int, max_tokens: int,
                       batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive non-overlapping windows from the start of a split, for evaluation.

    Window i predicts tokens ``[i*T + 1, (i+1)*T + 1)`` from the ``T`` before each. At most
    ``max_tokens`` target tokens are yielded (rounded down to whole windows), at least one window
    when the split has ``T + 1`` tokens.

    Yields:
        (x, y): (b, T) int64 each, b <= batch_size.
    """
    windows = min(max(max_tokens // seq_len, 1), (stream.num_tokens - 1) // seq_len)
    for lo in range(0, windows, batch_size):
        rows = np.stack([stream.read(i * seq_len, seq_len + 1) for i in range(lo, min(lo + batch_size, windows))])
        xy = torch.from_numpy(rows)
        yield xy[:, :-1], xy[:, 1:]
