"""Dataset manifest: digest, load, verify (docs/contracts.md, "Dataset").

A dataset folder without a ``manifest.json`` that verifies does not exist: :func:`verify_dataset`
checks the format, every file's size and SHA-256, that shard sizes match their token counts and
dtype, that the split totals add up, that every id is below ``vocab_size``, that each split
ends with the EOS id and that ``eos_ids`` (optional: manifests before it lack it) holds it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from trainforge.contract import DATASET_FORMAT as FORMAT
from trainforge.contract import DATASET_MANIFEST as MANIFEST_NAME
from trainforge.contract import DATASET_SPLITS as SPLITS
from trainforge.data.errors import DatasetInvalidError
from trainforge.storage.files import sha256_file

TOKENIZER_NAME = "tokenizer.json"
#: Bump when a code change alters the prepared output for the same sources and settings.
#: 2: streamed multi-format sources, max length and malformed-record settings, document index
#: files, tokenizer reuse.
RECIPE_VERSION = 2
_READ_CHUNK_BYTES = 1 << 20  # a multiple of 4: chunks never split a uint16/uint32 id


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the bytes that digests are taken of."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def dataset_digest(*, sources: list[dict[str, Any]], settings: dict[str, Any],
                   tokenizers_version: str) -> str:
    """SHA-256 hex of the canonical JSON of everything that determines the dataset.

    Args:
        sources: each file's identity, ``{"name", "sha256"}`` (local) or ``{"name", "bytes",
            "etag"}`` (S3), any order (sorted here).
        settings: :meth:`PrepareSettings.output_settings` plus the reused tokenizer's SHA-256.
        tokenizers_version: ``tokenizers.__version__`` (BPE training may change between versions).
    """
    payload = {
        "format": FORMAT,
        "recipe": RECIPE_VERSION,
        "tokenizers_version": tokenizers_version,
        "settings": settings,
        "sources": sorted((dict(s) for s in sources),
                          key=lambda s: (s["name"], canonical_json(s))),
    }
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def load_manifest(dataset_dir: Path | str) -> dict[str, Any]:
    """Read ``dataset_dir/manifest.json`` without checking the files (see :func:`verify_dataset`).

    Raises:
        DatasetInvalidError: missing, not JSON, not an object, or of another format.
    """
    path = Path(dataset_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetInvalidError(str(dataset_dir), [f"no {MANIFEST_NAME}"]) from None
    except (OSError, ValueError) as err:
        raise DatasetInvalidError(str(dataset_dir), [f"unreadable {MANIFEST_NAME}: {err}"]) from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DatasetInvalidError(str(dataset_dir), [f"format is {got!r}, expected {FORMAT!r}"])
    return manifest


def verify_dataset(dataset_dir: Path | str) -> list[str]:
    """Check a dataset folder against its manifest; returns the problems (empty: it is valid).

    Reads every file once (hash, size, id range, final EOS). Never raises for a bad dataset.
    """
    folder = Path(dataset_dir)
    try:
        manifest = load_manifest(folder)
    except DatasetInvalidError as err:
        return err.problems
    try:
        return _verify(folder, manifest)
    except (KeyError, TypeError, ValueError) as err:
        return [f"malformed {MANIFEST_NAME}: {type(err).__name__}: {err}"]


def _verify(folder: Path, manifest: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    dtype_name = manifest["dtype"]
    if dtype_name not in ("uint16", "uint32"):
        return [f"dtype is {dtype_name!r}, expected 'uint16' or 'uint32'"]
    dtype = np.dtype(dtype_name).newbyteorder("<")
    vocab_size, eos_id = int(manifest["vocab_size"]), int(manifest["eos_id"])
    eos_ids = manifest.get("eos_ids", [eos_id])
    if (not isinstance(eos_ids, list) or eos_id not in eos_ids
            or not all(type(i) is int and 0 <= i < vocab_size for i in eos_ids)):
        problems.append(f"eos_ids is {eos_ids!r}, expected a list of ids < vocab_size "
                        f"{vocab_size} holding eos_id {eos_id}")
    problems += _check_file(folder, manifest["tokenizer"])
    if isinstance((manifest.get("examples") or {}).get("chat_template"), dict):
        problems += _check_file(folder, manifest["examples"]["chat_template"])
    for split in SPLITS:
        entry = manifest["splits"][split]
        if "index" in entry:
            problems += _check_file(folder, entry["index"])
        shards = entry["shards"]
        if not shards:
            problems.append(f"split {split!r} has no shards")
            continue
        if sum(int(s["tokens"]) for s in shards) != int(entry["tokens"]):
            problems.append(f"split {split!r}: shard tokens do not add up to {entry['tokens']}")
        last_id = None
        examples = "examples" in manifest  # conversations: no EOS between them; masks and offsets
        for shard in shards:
            if examples:
                problems += _check_examples(folder, shard, int(manifest["examples"]["sequence_length"]))
            if int(shard["bytes"]) != int(shard["tokens"]) * dtype.itemsize:
                problems.append(f"{shard['file']}: {shard['bytes']} bytes for {shard['tokens']} "
                                f"{dtype_name} tokens")
            shard_problems, max_id, last = _check_shard(folder, shard, dtype)
            problems += shard_problems
            if max_id is not None and max_id >= vocab_size:
                problems.append(f"{shard['file']}: token id {max_id} >= vocab_size {vocab_size}")
            last_id = last
        if last_id is not None and last_id != eos_id and not examples:
            problems.append(f"split {split!r} does not end with the EOS id {eos_id}")
    return problems


def _check_examples(folder: Path, shard: dict[str, Any], sequence_length: int) -> list[str]:
    """An examples shard's loss mask (one 0/1 byte per token) and offsets (0 to its tokens,
    rising, no example longer than ``sequence_length``)."""
    problems = _check_file(folder, shard["loss_mask"]) + _check_file(folder, shard["examples"])
    if problems:
        return problems
    tokens = int(shard["tokens"])
    mask = np.fromfile(folder / shard["loss_mask"]["file"], dtype=np.uint8)
    offsets = np.fromfile(folder / shard["examples"]["file"], dtype=np.dtype("<i8"))
    if len(mask) != tokens or int(mask.max(initial=0)) > 1:
        problems.append(f"{shard['loss_mask']['file']}: expected {tokens} bytes of 0 or 1")
    lengths = np.diff(offsets)
    if (len(offsets) != int(shard["examples"]["count"]) + 1 or not len(offsets) or offsets[0] != 0
            or offsets[-1] != tokens or (lengths <= 0).any() or (lengths > sequence_length).any()):
        problems.append(f"{shard['examples']['file']}: expected {shard['examples']['count']} + 1 rising offsets "
                        f"from 0 to {tokens}, no example longer than {sequence_length} tokens")
    return problems


def _check_file(folder: Path, entry: dict[str, Any]) -> list[str]:
    path = folder / entry["file"]
    try:
        size, sha = path.stat().st_size, sha256_file(path)
    except OSError as err:
        return [f"{entry['file']}: cannot read ({err.strerror or err})"]
    problems = []
    if size != int(entry["bytes"]):
        problems.append(f"{entry['file']}: {size} bytes, manifest says {entry['bytes']}")
    elif sha != entry["sha256"]:
        problems.append(f"{entry['file']}: sha256 {sha[:12]}..., "
                        f"manifest says {entry['sha256'][:12]}...")
    return problems


def _check_shard(folder: Path, entry: dict[str, Any], dtype: np.dtype
                 ) -> tuple[list[str], int | None, int | None]:
    """Hash a shard and scan its ids in one pass: (problems, max id, last id)."""
    path = folder / entry["file"]
    digest = hashlib.sha256()
    size, max_id, last_id = 0, None, None
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
                usable = len(chunk) - len(chunk) % dtype.itemsize
                if usable:
                    ids = np.frombuffer(chunk[:usable], dtype=dtype)
                    top = int(ids.max())
                    max_id = top if max_id is None else max(max_id, top)
                    last_id = int(ids[-1])
    except OSError as err:
        return [f"{entry['file']}: cannot read ({err.strerror or err})"], None, None
    if size != int(entry["bytes"]):
        return [f"{entry['file']}: {size} bytes, manifest says {entry['bytes']}"], max_id, last_id
    if digest.hexdigest() != entry["sha256"]:
        return [f"{entry['file']}: sha256 does not match the manifest"], max_id, last_id
    return [], max_id, last_id
