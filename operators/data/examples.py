"""Write an examples dataset: rendered conversations with their loss masks, as docs/contracts.md
("Examples datasets") defines it. `write_examples_dataset` writes the shards, their loss masks
and example offsets, the tokenizer and the manifest (last) into a folder; data preparation
calls it on a staging folder that it renames into place.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainforge.contract import DATASET_FORMAT, DATASET_MANIFEST, DATASET_SPLITS
from trainforge.storage.files import atomic_write_json, sha256_file

#: An example: (token ids, loss mask) of equal length, optionally its text's UTF-8 bytes.
Example = tuple[Sequence[int], Sequence[int]] | tuple[Sequence[int], Sequence[int], int]


def _file_entry(path: Path) -> dict[str, Any]:
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_split(folder: Path, split: str, examples: Iterable[Example], dtype: str,
                shard_tokens: int) -> dict[str, Any]:
    """Write ``split``'s examples into shards of at most ``shard_tokens`` tokens (an example
    longer than that gets a shard of its own) with their ``.mask`` and ``.idx`` files; returns
    the split's manifest entry."""
    shards: list[dict[str, Any]] = []
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    offsets = [0]
    totals = {"documents": 0, "tokens": 0, "loss_tokens": 0, "bytes_utf8": 0}

    def flush() -> None:
        if len(offsets) == 1:
            return
        stem = f"{split}-{len(shards):05d}"
        bin_path, mask_path, idx_path = (folder / f"{stem}{suffix}" for suffix in (".bin", ".mask", ".idx"))
        np.concatenate(ids).astype(np.dtype(dtype).newbyteorder("<")).tofile(bin_path)
        np.concatenate(masks).astype(np.uint8).tofile(mask_path)
        np.asarray(offsets, dtype=np.dtype("<i8")).tofile(idx_path)
        shards.append({**_file_entry(bin_path), "tokens": offsets[-1], "loss_mask": _file_entry(mask_path),
                       "examples": {**_file_entry(idx_path), "count": len(offsets) - 1}})
        ids.clear(), masks.clear()
        del offsets[1:]

    for example in examples:
        tokens, mask = np.asarray(example[0], dtype=np.int64), np.asarray(example[1], dtype=np.uint8)
        if tokens.shape != mask.shape or tokens.ndim != 1 or not len(tokens):
            raise ValueError(f"an example needs ids and a mask of one equal, non-zero length "
                             f"(got {tokens.shape} and {mask.shape})")
        if offsets[-1] and offsets[-1] + len(tokens) > shard_tokens:
            flush()
        ids.append(tokens)
        masks.append(mask)
        offsets.append(offsets[-1] + len(tokens))
        totals["documents"] += 1
        totals["tokens"] += len(tokens)
        totals["loss_tokens"] += int(mask.sum())
        totals["bytes_utf8"] += int(example[2]) if len(example) > 2 else 0
    flush()
    return {**totals, "shards": shards}


def write_examples_dataset(folder: str | Path, splits: dict[str, Iterable[Example]], *, tokenizer_file: str | Path,
                           vocab_size: int, eos_token: str, eos_id: int, digest: str,
                           examples: dict[str, Any], eos_ids: Sequence[int] | None = None,
                           shard_tokens: int = 1 << 24, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write a whole examples dataset into ``folder`` (created; its manifest last) and return
    the manifest. ``examples`` is the manifest's top-level ``examples`` object (kind,
    chat_template_sha256, sequence_length, over_length, pad_id); ``extra`` adds top-level keys
    (sources, settings, stats)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    tokenizer = folder / "tokenizer.json"
    shutil.copyfile(tokenizer_file, tokenizer)
    entries = {name: write_split(folder, name, splits.get(name, ()), dtype, shard_tokens) for name in DATASET_SPLITS}
    manifest = {"format": DATASET_FORMAT, "digest": digest, "dtype": dtype, "vocab_size": vocab_size,
                "eos_token": eos_token, "eos_id": eos_id, "eos_ids": list(eos_ids or [eos_id]),
                "tokenizer": _file_entry(tokenizer), "splits": entries, "examples": dict(examples),
                **(extra or {})}
    atomic_write_json(folder / DATASET_MANIFEST, manifest)
    return manifest
