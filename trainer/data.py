"""Prepared datasets (docs/contracts.md, "Dataset"): opening one, token streams, batches.

Sampling is a pure function of ``(seed, step)``, so a resumed run sees exactly the batches an
uninterrupted one would, with no dataloader state to save. A document stream (`BatchSampler`):

    rng     = numpy Generator(PCG64(SeedSequence([seed, step])))
    starts  = rng.integers(0, N - T, size=global_batch)      # N train tokens, T = seq_len
    rank r  takes starts[r*A*m : (r+1)*A*m], A = accumulation steps, m = micro batch
    micro-step a takes the a-th block of m starts of that slice
    x = tokens[s : s+T], y = tokens[s+1 : s+T+1]             # (m, T) int64 each

An examples dataset (`ExampleSampler`): epoch e's order of the E train examples is
``PCG64(SeedSequence([seed, e])).permutation(E)``; step s takes global positions
``[s*G, (s+1)*G)`` of the epochs' orders laid end to end (G = global batch), split over ranks and
micro-batches as above; each example becomes one row padded to T (`pad_examples`). With
``data.packing`` (`PackedExampleSampler`) each epoch's order is packed greedily into rows of
several examples (trainforge.trainer.packing), and step s takes rows ``[s*G, (s+1)*G)``.

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
from trainforge.trainer.errors import ConfigError, DatasetError
from trainforge.trainer.loss import IGNORE_INDEX
from trainforge.trainer.packing import pack_examples, pack_rows


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


class ExampleIndex:
    """The examples of one split of an examples dataset: ``example(k)`` is its tokens and loss mask."""

    def __init__(self, dataset: Dataset, split: str) -> None:
        if dataset.examples is None:
            raise DatasetError(f"dataset {dataset.dir} holds a document stream, not examples")
        self.stream = TokenStream(dataset, split)
        shards = [s for s in dataset.splits[split].shards if s.tokens > 0]
        self.masks = [np.memmap(s.mask_path, dtype=np.uint8, mode="r") for s in shards]
        mask_starts = np.cumsum([0] + [len(m) for m in self.masks])  # (n_shards + 1,)
        bounds = [np.fromfile(s.offsets_path, dtype="<i8") + base for s, base in zip(shards, self.stream.starts)]
        self.starts = np.concatenate([b[:-1] for b in bounds] or [np.empty(0, np.int64)])  # (E,) stream offsets
        self.lengths = np.concatenate([np.diff(b) for b in bounds] or [np.empty(0, np.int64)])  # (E,) tokens
        self._mask_starts = mask_starts
        self.pad_id = dataset.examples.pad_id

    def __len__(self) -> int:
        return len(self.starts)

    def example(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Example ``k``: (tokens (L,) int64, loss mask (L,) uint8). No example spans two shards."""
        start, length = int(self.starts[k]), int(self.lengths[k])
        i = int(np.searchsorted(self._mask_starts, start, side="right")) - 1
        lo = start - int(self._mask_starts[i])
        return self.stream.read(start, length), np.asarray(self.masks[i][lo:lo + length])


def pad_examples(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int,
                 pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per example, right-padded to ``seq_len``: (x, y), (len(examples), seq_len) int64 each.

    ``x = t[:-1]`` then ``pad_id``; ``y[j] = t[j + 1]`` where ``mask[j + 1]`` is 1, else (and in
    the padding) `IGNORE_INDEX`. Right padding needs no attention mask with a causal model: every
    padding position comes after every real token of its row, so no real token attends to one,
    and padding positions predict nothing.

    Raises:
        DatasetError: an example has more than ``seq_len + 1`` tokens.
    """
    x = torch.full((len(examples), seq_len), pad_id, dtype=torch.int64)
    y = torch.full((len(examples), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for row, (tokens, mask) in enumerate(examples):
        n = len(tokens) - 1  # predictions the example gives
        if n > seq_len:
            raise DatasetError(f"an example of {len(tokens)} tokens does not fit data.sequence_length={seq_len} "
                               f"(at most sequence_length + 1 tokens)")
        t = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        x[row, :n] = t[:-1]
        y[row, :n] = torch.where(torch.from_numpy(np.asarray(mask[1:], dtype=bool)), t[1:], IGNORE_INDEX)
    return x, y


class ExampleSampler:
    """Deterministic training batches of whole examples, padded: see the module docstring.

    Same interface as `BatchSampler`; a micro-batch's ``y`` holds `IGNORE_INDEX` outside the loss
    mask and in the padding, so micro-batches differ in their loss tokens (trainer/train.py
    normalises by the global batch's count).

    Raises:
        DatasetError: no train examples, or the dataset's examples.sequence_length does not fit
            ``seq_len`` (an example of L tokens needs L - 1 <= seq_len).
    """

    def __init__(self, index: ExampleIndex, seq_len: int, micro_batch: int, accum_steps: int,
                 world_size: int, seed: int, examples_seq_len: int | None = None) -> None:
        if len(index) == 0:
            raise DatasetError("the train split holds no examples")
        longest = examples_seq_len if examples_seq_len is not None else int(index.lengths.max())
        if longest - 1 > seq_len:
            raise DatasetError(f"the dataset's examples.sequence_length={longest} does not fit "
                               f"data.sequence_length={seq_len}: expected at most {seq_len + 1}")
        self.index, self.seq_len, self.micro_batch = index, seq_len, micro_batch
        self.accum_steps, self.world_size, self.seed = accum_steps, world_size, seed
        self.global_batch = micro_batch * accum_steps * world_size
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s permutation of the train examples: (E,) int64."""
        if epoch not in self._orders:
            if len(self._orders) > 2:  # a step spans at most a few epochs; keep the newest
                del self._orders[min(self._orders)]
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._orders[epoch] = rng.permutation(len(self.index))
        return self._orders[epoch]

    def examples(self, step: int) -> np.ndarray:
        """Example indices of all rows of optimizer step ``step``: (global_batch,) int64."""
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        epochs, within = np.divmod(positions, len(self.index))
        return np.array([self.order(int(e))[int(p)] for e, p in zip(epochs, within)], dtype=np.int64)

    def micro_batches(self, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's ``accum_steps`` micro-batches of step ``step``: [(x, y)], each (m, T) int64."""
        per_rank = self.micro_batch * self.accum_steps
        mine = self.examples(step)[rank * per_rank:(rank + 1) * per_rank]
        return [pad_examples([self.index.example(int(k)) for k in mine[a * self.micro_batch:(a + 1) * self.micro_batch]],
                             self.seq_len, self.index.pad_id)
                for a in range(self.accum_steps)]


class PackedExampleSampler(ExampleSampler):
    """Deterministic training batches of packed rows, a pure function of ``(seed, step)``.

    Epoch e's plan: its permutation of the E train examples (`ExampleSampler.order`), cut by
    `pack_rows` into rows in that order: an example of L tokens takes L - 1 positions (its last
    token is a target only), and an example that would take the row past T = ``seq_len``
    positions starts the next row. Every example is in exactly one row per epoch. The epochs'
    rows are laid end to end; step s takes rows ``[s*G, (s+1)*G)`` (G = global batch, in rows),
    split over ranks and micro-batches as `ExampleSampler` splits its examples, and
    `pack_examples` turns each micro-batch into (x, y, position_ids).

    Raises:
        DatasetError: as `ExampleSampler`.
    """

    def __init__(self, index: ExampleIndex, seq_len: int, micro_batch: int, accum_steps: int,
                 world_size: int, seed: int, examples_seq_len: int | None = None) -> None:
        super().__init__(index, seq_len, micro_batch, accum_steps, world_size, seed, examples_seq_len)
        self._predictions = np.maximum(index.lengths - 1, 0)  # (E,) positions each example takes
        self._row_starts = [0]  # rows before epoch e, for the epochs planned so far
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s (order (E,), row bounds (R + 1,)): row r is ``order[bounds[r]:bounds[r+1]]``."""
        if epoch not in self._plans:
            if len(self._plans) > 2:  # a step spans at most a few epochs; keep the newest
                del self._plans[min(self._plans)]
            order = self.order(epoch)
            self._plans[epoch] = (order, pack_rows(self._predictions[order], self.seq_len))
        return self._plans[epoch]

    def _epoch_of_row(self, row: int) -> tuple[int, int]:
        """(epoch, row within it) of global row ``row``, planning epochs up to it."""
        while self._row_starts[-1] <= row:
            epoch = len(self._row_starts) - 1
            self._row_starts.append(self._row_starts[-1] + len(self.plan(epoch)[1]) - 1)
        epoch = int(np.searchsorted(self._row_starts, row, side="right")) - 1
        return epoch, row - self._row_starts[epoch]

    def rows(self, step: int) -> list[np.ndarray]:
        """The example indices of each of step ``step``'s G rows, in row order."""
        out = []
        for row in range(step * self.global_batch, (step + 1) * self.global_batch):
            epoch, r = self._epoch_of_row(row)
            order, bounds = self.plan(epoch)
            out.append(order[bounds[r]:bounds[r + 1]])
        return out

    def micro_batches(self, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's ``accum_steps`` micro-batches of step ``step``: [(x, y, position_ids)], each (m, T) int64."""
        per_rank = self.micro_batch * self.accum_steps
        mine = self.rows(step)[rank * per_rank:(rank + 1) * per_rank]
        out = []
        for a in range(self.accum_steps):
            block = mine[a * self.micro_batch:(a + 1) * self.micro_batch]
            out.append(pack_examples([[self.index.example(int(k)) for k in row] for row in block],
                                     self.seq_len, self.index.pad_id))
        return out


def make_sampler(dataset: Dataset, seq_len: int, micro_batch: int, accum_steps: int, world_size: int,
                 seed: int, packing: bool = False) -> BatchSampler | ExampleSampler:
    """The train sampler for ``dataset``: whole examples for an examples dataset (packed several to
    a row with ``packing``: trainforge.trainer.packing), else windows.

    Raises:
        ConfigError: ``packing`` with a document stream (exit code 78).
        DatasetError: as the sampler's constructor.
    """
    if packing and dataset.examples is None:
        raise ConfigError(f"data.packing=true but dataset {dataset.dir} holds a document stream (text data): "
                          f"expected an examples dataset (data.format chat or prompt_completion), or packing false")
    if packing:
        return PackedExampleSampler(ExampleIndex(dataset, "train"), seq_len, micro_batch, accum_steps, world_size,
                                    seed, dataset.examples.sequence_length)
    if dataset.examples is not None:
        return ExampleSampler(ExampleIndex(dataset, "train"), seq_len, micro_batch, accum_steps, world_size, seed,
                              dataset.examples.sequence_length)
    return BatchSampler(TokenStream(dataset, "train"), seq_len, micro_batch, accum_steps, world_size, seed)


def validation_examples(index: ExampleIndex, seq_len: int, max_tokens: int,
                        batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The split's examples in order, padded as `pad_examples` does, for evaluation: whole
    examples while their loss tokens stay within ``max_tokens`` (at least one example).

    Yields:
        (x, y): (b, T) int64 each, b <= batch_size.
    """
    chosen, loss_tokens = [], 0
    for k in range(len(index)):
        tokens, mask = index.example(k)
        loss_tokens += int(np.count_nonzero(mask[1:]))
        if k and loss_tokens > max_tokens:
            break
        chosen.append((tokens, mask))
        if len(chosen) == batch_size:
            yield pad_examples(chosen, seq_len, index.pad_id)
            chosen = []
    if chosen:
        yield pad_examples(chosen, seq_len, index.pad_id)
