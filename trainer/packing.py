"""Packing an examples dataset: several whole examples per training sequence, none attending to
another (``data.packing: true``; docs/trainer.md, "Packing"). The sampler that plans which
examples share a row is trainforge.trainer.data.PackedExampleSampler.

A row's position ids restart at 0 for each example; transformers' causal-mask builders read
restarting position ids as packed sequences and mask attention per example (with sliding
windows where the model has them), for every attention kernel. Never builds attention masks of
its own: a ready 4-D mask would bypass the model's sliding windows and differ by kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from trainforge.trainer.errors import DatasetError
from trainforge.trainer.loss import IGNORE_INDEX


def pack_rows(predictions: np.ndarray, seq_len: int) -> np.ndarray:
    """Greedy packing in order: the bounds of the rows, (R + 1,) int64, row r holding items
    ``[bounds[r], bounds[r + 1])``. An item goes into the current row while the row's
    ``predictions`` stay within ``seq_len``, else it starts the next row.

    Args:
        predictions: (E,) int64, each item's positions (an example of L tokens: L - 1).
    Raises:
        DatasetError: an item alone takes more than ``seq_len`` positions.
    """
    if len(predictions) and int(predictions.max()) > seq_len:
        k = int(predictions.argmax())
        raise DatasetError(f"an example of {int(predictions[k]) + 1} tokens does not fit "
                           f"data.sequence_length={seq_len} (at most sequence_length + 1 tokens)")
    bounds, used = [0], 0
    for i, n in enumerate(predictions.tolist()):
        if used + n > seq_len:
            bounds.append(i)
            used = 0
        used += n
    bounds.append(len(predictions))
    return np.asarray(bounds if len(predictions) else [0], dtype=np.int64)


def pack_examples(rows: list[list[tuple[np.ndarray, np.ndarray]]], seq_len: int,
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's examples laid end to end, right-padded to ``seq_len``: (x, y, position_ids),
    (len(rows), seq_len) int64 each.

    An example of L tokens ``t`` with loss mask ``mask`` takes L - 1 positions: ``x = t[:-1]``,
    ``y[j] = t[j + 1]`` where ``mask[j + 1]`` is 1 else `IGNORE_INDEX`, position ids
    ``0 .. L - 2`` (as the example alone, unpadded). The padding after the last example holds
    ``pad_id``, `IGNORE_INDEX` targets and position ids restarting at 0: a block of its own,
    which no real token attends to.

    Raises:
        DatasetError: a row's examples take more than ``seq_len`` positions.
    """
    x = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)
    y = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros((len(rows), seq_len), dtype=torch.int64)
    for r, examples in enumerate(rows):
        at = 0
        for tokens, mask in examples:
            n = len(tokens) - 1  # predictions the example gives
            if at + n > seq_len:
                raise DatasetError(f"packed row {r}: its examples take more than data.sequence_length={seq_len} "
                                   f"positions ({at} + {n})")
            t = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
            x[r, at:at + n] = t[:-1]
            y[r, at:at + n] = torch.where(torch.from_numpy(np.asarray(mask[1:], dtype=bool)), t[1:], IGNORE_INDEX)
            positions[r, at:at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(seq_len - at)
    return x, y, positions
