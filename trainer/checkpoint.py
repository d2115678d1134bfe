"""Checkpoints (docs/contracts.md, "Checkpoint layout"): write, prune, load.

    <root>/step-00000100/
      model.safetensors   weights, each storage once (a tied lm_head is stored as the embedding)
      optimizer.pt        AdamW state_dict (torch.save; read back with weights_only=True)
      trainer_state.pt    {"step", "tokens_seen", "world_size", "scheduler": {"step"},
                           "rng": [per rank {"torch", "cuda", "numpy", "python"}]}
      meta.json           step, tokens_seen, world_size, world_size_history, digests, job config,
                          versions, metrics (and "powersgd" under PowerSGD)
      powersgd-rank-<r>.pt  under gradient_compression "powersgd" only: rank r's PowerSGD state
                          (trainforge.trainer.powersgd.state_dict), one file per rank
      manifest.json       written LAST, atomically: {"format", "step", "files": {name: {bytes, sha256}}}

File names, the manifest, `verify` and `newest_valid` are trainforge.trainer.checkpoint_manifest
(all importable from here too). The root is a local folder (``Path`` or a path string) or an
``s3://bucket/prefix`` string; the same layout and rules hold on both through
:mod:`trainforge.storage`. The files are written into the step folder (on S3: a local staging
folder, then uploaded, multipart and retried) and only then is ``manifest.json`` written in one
atomic step (a rename on disk, one PutObject on S3): a reader that sees the manifest sees every
file it lists, and an attempt killed before it leaves no checkpoint. The trainer calls
`write_checkpoint` and `apply_retention` on its writer thread
(trainforge.trainer.checkpoint_writer); nothing here runs a collective.
"""
from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from trainforge.storage import Location, StorageError, storage_for
from trainforge.storage.files import chmod_like_umask
from trainforge.storage.settle import size_written
# The layout's names, read_manifest, verify and newest_valid are also read from here.
from trainforge.trainer.checkpoint_manifest import (  # noqa: F401
    CHECKPOINT_FORMAT,
    MANIFEST,
    META,
    OPTIMIZER,
    QUARANTINE_REASON,
    REQUIRED_FILES,
    TRAINER_STATE,
    WEIGHTS,
    forget_written,
    join,
    just_written,
    list_step_dirs,
    located,
    newest_valid,
    powersgd_file,
    read_manifest,
    remember_written,
    step_dir,
    step_dir_name,
    verify,
)
from trainforge.trainer.errors import CheckpointError
from trainforge.trainer.hashing import hash_threads

log = logging.getLogger(__name__)


def world_size_history(resumed_meta: dict[str, Any] | None, world_size: int) -> list[dict[str, int]]:
    """meta.json's ``world_size_history``: ``[{"from_step": N, "world_size": W}, ...]``, oldest
    first, one entry per world size the run has trained on since step ``from_step``.

    Args:
        resumed_meta: meta.json of the checkpoint this attempt resumed from (None: a fresh start).
            A checkpoint written before the history existed counts as its ``world_size`` from 0.
        world_size: this attempt's world size; a new entry starts at the resumed step when it
            differs from the last one.
    """
    if not resumed_meta:
        return [{"from_step": 0, "world_size": world_size}]
    history = [dict(h) for h in resumed_meta.get("world_size_history") or []]
    if not history and resumed_meta.get("world_size") is not None:
        history = [{"from_step": 0, "world_size": int(resumed_meta["world_size"])}]
    if not history or history[-1]["world_size"] != world_size:
        history.append({"from_step": int(resumed_meta.get("step", 0)), "world_size": world_size})
    return history


def write_checkpoint(root: str | Path, step: int, weights: dict[str, torch.Tensor], optimizer_state: dict,
                     trainer_state: dict, meta: dict, rank_files: dict[str, Any] | None = None,
                     commit_guard: Callable[[], AbstractContextManager[Any]] | None = None) -> Location:
    """Write ``root/step-XXXXXXXX/`` with the manifest last (rank 0 only); returns the folder.

    An existing folder of the same step is kept when it verifies (nothing is rewritten) and
    replaced otherwise (a partial write from a killed attempt: its manifest is deleted first, so
    it stops existing before anything else changes).

    Args:
        weights: name -> contiguous CPU tensor, no two sharing storage.
        rank_files: file name -> object, each written with ``torch.save`` beside the required
            files (per-rank state such as `powersgd_file`), published, listed and hashed in the
            manifest like them; plain values and CPU tensors only (they are loaded with
            ``weights_only=True``).
        commit_guard: entered around the manifest write; it may raise `CheckpointError` to stop
            the commit (`trainforge.trainer.checkpoint_writer`: nothing is published after the
            write was abandoned).
    Raises:
        CheckpointError: a file could not be written (disk full, permissions, S3 after retries),
            or ``commit_guard`` refused the commit.
    """
    store, root = located(root)
    step_dir = store.join(root, step_dir_name(step))
    try:
        if store.is_dir(step_dir):
            if not verify(step_dir):
                log.info("checkpoint %s already exists and verifies; not rewriting it", step_dir)
                return step_dir
            log.warning("replacing incomplete checkpoint folder %s (its manifest first)", step_dir)
            forget_written(store.join(step_dir, MANIFEST))
            store.delete_dir(step_dir, first=MANIFEST)
        with store.staging_dir(step_dir) as folder:
            safetensors.torch.save_file(weights, folder / WEIGHTS, metadata={"format": "pt"})
            chmod_like_umask(folder / WEIGHTS)
            torch.save(optimizer_state, folder / OPTIMIZER)
            torch.save(trainer_state, folder / TRAINER_STATE)
            for name, value in (rank_files or {}).items():
                torch.save(value, folder / name)
            (folder / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            names = (*REQUIRED_FILES, *(rank_files or {}))
            store.publish(folder, step_dir, names)
            files = {name: {"bytes": (folder / name).stat().st_size, "sha256": digest}
                     for name, digest in _digests(folder, names).items()}  # what was written, after fsync
            manifest = {"format": CHECKPOINT_FORMAT, "step": step, "files": files}
            with commit_guard() if commit_guard else nullcontext():
                store.write_bytes(store.join(step_dir, MANIFEST), (json.dumps(manifest, indent=2) + "\n").encode())
                remember_written(store.join(step_dir, MANIFEST))
    except (OSError, StorageError) as err:
        raise CheckpointError(f"writing checkpoint {step_dir} failed: {err}") from err
    return step_dir


def _digests(folder: Path, names: tuple[str, ...]) -> dict[str, str]:
    """SHA-256 of each of ``names`` in the local ``folder``, hashed side by side."""
    local = storage_for(folder)
    with ThreadPoolExecutor(hash_threads(len(names)), thread_name_prefix="sha256") as pool:
        return dict(zip(names, pool.map(lambda name: local.sha256(folder / name), names)))


def apply_retention(root: str | Path, keep_last: int, trusted: Location | None = None) -> list[Location]:
    """Delete all but the newest ``keep_last`` valid checkpoints; returns the folders deleted.

    Also deletes folders that do not verify when they are older than the newest valid one
    (partial writes of killed attempts). ``trusted``: the folder the caller has just written and
    hashed, checked by size only. Never deletes the newest valid checkpoint, nor
    anything newer than it (it may be a write in progress). Each folder loses its manifest
    first, so a folder half deleted is no checkpoint.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: expected >= 1")
    store, root = located(root)
    dirs = list_step_dirs(root)
    # ``trusted`` was hashed from the bytes on disk moments ago: its sizes are checked, not its
    # bytes again (re-hashing a 13 GB checkpoint took 8-19 s of each background write).
    trusted_at = None if trusted is None else str(store.join(trusted))
    valid = [(s, p) for s, p in reversed(dirs) if not verify(p, hashes=str(p) != trusted_at)]  # newest first
    if not valid:
        return []
    newest_step = valid[0][0]
    keep = {p for _, p in valid[:keep_last]}
    doomed = [p for s, p in dirs if p not in keep and s < newest_step]
    for path in doomed:
        log.info("retention (keep_last=%d): deleting %s", keep_last, path)
        forget_written(store.join(path, MANIFEST))
        store.delete_dir(path, first=MANIFEST)
    return doomed


@contextmanager
def local_copy(step_dir: str | Path, written: bool | None = None,
               only: tuple[str, ...] | None = None) -> Iterator[Path]:
    """The step folder as a local folder of the same name: itself on disk; on S3 a temporary
    download of the manifest, every file it lists (those of them in ``only``, when given) and a
    QUARANTINE_REASON (so the copy refuses to verify too). Nothing is verified here: `verify`
    the copy (same bytes). ``written``: as for `read_manifest` (the manifest and its files get
    the read-after-write allowance).
    """
    store, step_dir = located(step_dir)
    fresh = just_written(store.join(step_dir, MANIFEST), written)
    try:
        names = list(read_manifest(step_dir, fresh)["files"])
    except CheckpointError:
        names = []  # the copy has no manifest either: every check says so
    if only is not None:
        names = [name for name in names if name in only]
    if fresh:
        for name in names:  # visible before the download looks for them
            size_written(store, store.join(step_dir, name), "checkpoint file")
    with store.local_dir(step_dir, [*names, QUARANTINE_REASON, MANIFEST]) as folder:
        yield folder


@dataclass
class Checkpoint:
    path: Location
    step: int
    weights: dict[str, torch.Tensor]  # as written: no tied aliases
    optimizer: dict[str, Any]
    trainer_state: dict[str, Any]
    meta: dict[str, Any]


def load_checkpoint(step_dir: str | Path) -> Checkpoint:
    """Read every file of a checkpoint onto the CPU without unpickling arbitrary objects.

    Does not verify hashes (call `verify` first; resume picks folders that verified).
    ``Checkpoint.path`` is ``step_dir`` as given (an S3 step is read from a temporary copy).

    Raises:
        CheckpointError: a file is missing or cannot be decoded.
    """
    where = located(step_dir)[1]
    try:
        with local_copy(where, only=REQUIRED_FILES) as folder:  # not every rank's files
            weights = safetensors.torch.load_file(folder / WEIGHTS, device="cpu")
            optimizer = torch.load(folder / OPTIMIZER, map_location="cpu", weights_only=True)
            state = torch.load(folder / TRAINER_STATE, map_location="cpu", weights_only=True)
            meta = json.loads((folder / META).read_text(encoding="utf-8"))
    except Exception as err:  # storage, safetensors, pickle and JSON each raise their own types
        raise CheckpointError(f"loading checkpoint {where} failed: {type(err).__name__}: {err}") from err
    return Checkpoint(where, int(state["step"]), weights, optimizer, state, meta)


def load_rank_file(step_dir: str | Path, name: str) -> Any:
    """One per-rank file of a checkpoint (`write_checkpoint`'s ``rank_files``), read with
    ``weights_only=True``; on S3 only that file is downloaded. Does not verify hashes.

    Raises:
        CheckpointError: the manifest does not list ``name``, or it cannot be read or decoded.
    """
    where = located(step_dir)[1]
    if name not in read_manifest(where)["files"]:
        raise CheckpointError(f"{join(where, name)}: not in the checkpoint's manifest")
    try:
        with local_copy(where, only=(name,)) as folder:
            return torch.load(folder / name, map_location="cpu", weights_only=True)
    except Exception as err:  # storage and pickle each raise their own types
        raise CheckpointError(f"loading {join(where, name)} failed: {type(err).__name__}: {err}") from err


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states in a form torch.load(weights_only=True) accepts."""
    np_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "python": random.getstate(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np_state = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937",
                         "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
                         "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]})
    random.setstate(state["python"])

