"""Checkpoints (docs/contracts.md, "Checkpoint layout"): write, verify, find, prune, load.

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

A folder counts as a checkpoint only when `verify` finds no problem; the manifest lists and
hashes the per-rank files like the others. ``step`` is the number of
optimizer steps completed; resuming from step-00000100 continues with step index 100.

The root is a local folder (``Path`` or a path string) or an ``s3://bucket/prefix`` string; the
same layout and rules hold on both through :mod:`trainforge.storage`. The files are written into
the step folder (on S3: a local staging folder, then uploaded, multipart and retried) and only
then is ``manifest.json`` written in one atomic step (a rename on disk, one PutObject on S3): a
reader that sees the manifest sees every file it lists, and an attempt killed before it leaves
no checkpoint. Locations come back as the caller gave them: ``Path`` on disk, URI strings on S3.
The trainer calls `write_checkpoint` and `apply_retention` on its writer thread
(trainforge.trainer.checkpoint_writer); nothing here runs a collective.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from trainforge.storage import Location, Storage, StorageError, storage_for
from trainforge.storage.files import chmod_like_umask
from trainforge.storage.settle import read_written, size_written
from trainforge.trainer.errors import CheckpointError
from trainforge.trainer.hashing import hash_threads

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "trainforge.checkpoint/v1"
MANIFEST = "manifest.json"
WEIGHTS, OPTIMIZER, TRAINER_STATE, META = "model.safetensors", "optimizer.pt", "trainer_state.pt", "meta.json"
REQUIRED_FILES = (WEIGHTS, OPTIMIZER, TRAINER_STATE, META)
# Written into a folder before it is moved aside (trainforge.trainer.quarantine): such a folder never verifies.
QUARANTINE_REASON = "QUARANTINE_REASON.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def powersgd_file(rank: int) -> str:
    """Name of rank ``rank``'s PowerSGD state file in a step folder: ``powersgd-rank-<rank>.pt``.

    A flat name: manifest entries are file names, not paths (`verify`)."""
    return f"powersgd-rank-{rank}.pt"


def _located(location: str | Path) -> tuple[Storage, Location]:
    """The storage of ``location`` and the location in its own type (``Path`` on disk)."""
    store = storage_for(location)
    return store, store.join(location)


def join(root: str | Path, name: str) -> str:
    """``root/name`` as a string, keeping an ``s3://`` URI intact (``Path`` would eat a slash)."""
    store, root = _located(root)
    return str(store.join(root, name))


def step_dir_name(step: int) -> str:
    """``step-00000100`` for step 100 (eight digits, zero-padded)."""
    return f"step-{step:08d}"


def step_dir(root: str | Path, step: int) -> Location:
    """``root/step-XXXXXXXX`` in the root's own type (``Path`` on disk, a URI string on S3)."""
    store, root = _located(root)
    return store.join(root, step_dir_name(step))


def list_step_dirs(root: str | Path) -> list[tuple[int, Location]]:
    """``(step, folder)`` of every ``step-*`` folder directly under ``root``, oldest first
    (valid or not)."""
    store, root = _located(root)
    found = [(int(m.group(1)), store.join(root, name)) for name in store.list_dirs(root)
             if (m := _STEP_DIR.match(name))]
    return sorted(found)


# Manifests this process wrote, by location, with when (time.monotonic()): reading one of them
# back is reading what the product just wrote, so "missing" is the store's read-after-write lag
# (trainforge.storage.settle), not an incomplete checkpoint. The newest few are kept.
_WRITTEN: dict[str, float] = {}
_WRITTEN_KEPT = 64


def _remember_written(manifest_at: Location) -> None:
    _WRITTEN[str(manifest_at)] = time.monotonic()
    for old in sorted(_WRITTEN, key=_WRITTEN.__getitem__)[:-_WRITTEN_KEPT]:
        del _WRITTEN[old]


def _just_written(manifest_at: Location, written: bool | None) -> bool:
    return written if written is not None else str(manifest_at) in _WRITTEN


def read_manifest(step_dir: str | Path, written: bool | None = None) -> dict[str, Any]:
    """The parsed manifest.json of a step folder.

    ``written``: the caller knows the product wrote this checkpoint (the trainer's final one,
    named in its result): a missing manifest is then read again for the store's read-after-write
    lag (:mod:`trainforge.storage.settle`). None (default): only when this process wrote it.

    Raises:
        CheckpointError: missing, unreadable, not JSON, or not a trainforge.checkpoint/v1 manifest.
    """
    store, step_dir = _located(step_dir)
    where = store.join(step_dir, MANIFEST)
    waited_s = 0.0
    try:
        if _just_written(where, written):
            data, waited_s = read_written(store, where, "checkpoint manifest")
        else:
            data = store.read_bytes(where)
    except StorageError as err:
        raise CheckpointError(f"{where}: unreadable ({err.cause})") from err
    if data is None:
        lag = f"; still missing after waiting {waited_s:.1f} s for the store" if waited_s else ""
        raise CheckpointError(f"{where}: missing (a folder without a manifest is not a checkpoint"
                              f"{lag})")
    try:
        manifest = json.loads(data)
    except ValueError as err:
        raise CheckpointError(f"{where}: unreadable ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{where}: format={got!r}, expected {CHECKPOINT_FORMAT!r}")
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"{where}: needs an integer 'step' and a 'files' object")
    return manifest


def verify(step_dir: str | Path, hashes: bool = True, max_threads: int | None = None,
           written: bool | None = None) -> list[str]:
    """Every problem that stops ``step_dir`` from being a checkpoint; empty when it verifies.

    Checks the manifest (present, format, step = folder name, lists every required file), that
    the folder was not quarantined (`QUARANTINE_REASON` present), and each listed file's size
    and, when ``hashes``, SHA-256 (4 MiB reads, streamed on S3; files hashed in parallel on up
    to ``max_threads`` threads, default one per file up to the usable cores: see
    trainforge.trainer.hashing). ``written``: as for `read_manifest`; the files of a checkpoint
    the product just wrote get the same read-after-write allowance.
    """
    store, step_dir = _located(step_dir)
    just_written = _just_written(store.join(step_dir, MANIFEST), written)
    try:
        manifest = read_manifest(step_dir, just_written)
    except CheckpointError as err:
        return [str(err)]
    problems = []
    m = _STEP_DIR.match(store.name(step_dir))
    if m is None or int(m.group(1)) != manifest["step"]:
        problems.append(f"{step_dir}: manifest step {manifest['step']} does not match the folder name")
    manifest_at = store.join(step_dir, MANIFEST)
    if store.size(store.join(step_dir, QUARANTINE_REASON)) is not None:
        problems.append(f"{store.join(step_dir, QUARANTINE_REASON)}: the checkpoint was quarantined; it is "
                        "never resumed from or registered")
    problems += [f"{manifest_at}: does not list required file {name}"
                 for name in REQUIRED_FILES if name not in manifest["files"]]
    to_hash: dict[Location, str] = {}
    for name, entry in manifest["files"].items():
        if Path(name).name != name or not isinstance(entry, dict):
            problems.append(f"{manifest_at}: bad entry for {name!r}")
            continue
        where = store.join(step_dir, name)
        size = (size_written(store, where, "checkpoint file")[0] if just_written
                else store.size(where))
        if size is None:
            problems.append(f"{where}: listed in the manifest but missing")
        elif size != entry.get("bytes"):
            problems.append(f"{where}: {size} bytes on disk, manifest says {entry.get('bytes')}")
        elif hashes:
            to_hash[where] = str(entry.get("sha256"))
    if to_hash:
        with ThreadPoolExecutor(hash_threads(len(to_hash), max_threads), thread_name_prefix="sha256") as pool:
            digests = dict(zip(to_hash, pool.map(lambda where: _sha256_or_problem(store, where), to_hash)))
        for where, got in digests.items():
            if got.startswith("unreadable"):
                problems.append(f"{where}: {got}")
            elif got != to_hash[where]:
                problems.append(f"{where}: SHA-256 {got[:16]}... does not match the manifest's "
                                f"{to_hash[where][:16]}...")
    return problems


def _sha256_or_problem(store: Storage, where: Location) -> str:
    """The file's SHA-256, or ``unreadable (<cause>)`` (one bad file must not hide the others)."""
    try:
        return store.sha256(where)
    except StorageError as err:
        return f"unreadable ({err.cause})"


def newest_valid(root: str | Path) -> Location | None:
    """The newest step folder under ``root`` that verifies, or None. Logs the ones skipped.

    Only ``step-*`` folders directly under ``root`` are candidates: ``quarantine/`` is never
    looked into, and a folder holding a QUARANTINE_REASON.json never verifies.
    """
    for _, path in reversed(list_step_dirs(root)):
        problems = verify(path)
        if not problems:
            return path
        log.warning("skipping %s: %s", path, "; ".join(problems))
    return None


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
    store, root = _located(root)
    step_dir = store.join(root, step_dir_name(step))
    try:
        if store.is_dir(step_dir):
            if not verify(step_dir):
                log.info("checkpoint %s already exists and verifies; not rewriting it", step_dir)
                return step_dir
            log.warning("replacing incomplete checkpoint folder %s (its manifest first)", step_dir)
            _WRITTEN.pop(str(store.join(step_dir, MANIFEST)), None)
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
                _remember_written(store.join(step_dir, MANIFEST))
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
    store, root = _located(root)
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
        _WRITTEN.pop(str(store.join(path, MANIFEST)), None)
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
    store, step_dir = _located(step_dir)
    just_written = _just_written(store.join(step_dir, MANIFEST), written)
    try:
        names = list(read_manifest(step_dir, just_written)["files"])
    except CheckpointError:
        names = []  # the copy has no manifest either: every check says so
    if only is not None:
        names = [name for name in names if name in only]
    if just_written:
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
    where = _located(step_dir)[1]
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
    where = _located(step_dir)[1]
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

