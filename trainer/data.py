"""Prepared datasets (docs/contracts.md, "Dataset"): opening one, token streams, batches.

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

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from trainforge.storage import storage_for
from trainforge.trainer.dataset import DTYPES, Dataset, read_dataset
from trainforge.trainer.dataset_cache import cached_dataset
from trainforge.trainer.errors import DatasetError


def open_dataset(location: str | Path, verify_hashes: bool = True) -> Dataset:
    """The dataset at ``location``, checked (`trainforge.trainer.dataset.read_dataset`).

    A local folder is read in place. Anything else (an ``s3://bucket/prefix/<digest>``) is read
    through this machine's cache (`trainforge.trainer.dataset_cache`: downloaded once, verified,
    renamed into place): shards are memory-mapped, so they must be local files.
    ``Dataset.dir`` is the folder read.

    Raises:
        DatasetError: missing, or it does not verify (exit code 78: the dataset does not exist).
        StorageError: an S3 dataset could not be read after retries (transient).
    """
    store = storage_for(location)
    folder = store.local_path(location)
    if folder is None:
        return cached_dataset(store, str(location), verify_hashes)
    return read_dataset(folder, verify_hashes)


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
