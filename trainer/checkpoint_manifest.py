"""Checkpoint folders (docs/contracts.md, "Checkpoint layout"): file names, step folders, the
manifest, `verify` and `newest_valid`; trainforge.trainer.checkpoint writes and loads them.

A folder counts as a checkpoint only when `verify` finds no problem; the manifest lists and
hashes the per-rank files like the others. ``step`` is the number of optimizer steps completed;
resuming from step-00000100 continues with step index 100. Locations come back as the caller
gave them: ``Path`` on disk, URI strings on S3 (:mod:`trainforge.storage`).
"""

from __future__ import annotations

import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainforge.storage import Location, Storage, StorageError, storage_for
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


def located(location: str | Path) -> tuple[Storage, Location]:
    """The storage of ``location`` and the location in its own type (``Path`` on disk)."""
    store = storage_for(location)
    return store, store.join(location)


def join(root: str | Path, name: str) -> str:
    """``root/name`` as a string, keeping an ``s3://`` URI intact (``Path`` would eat a slash)."""
    store, root = located(root)
    return str(store.join(root, name))


def step_dir_name(step: int) -> str:
    """``step-00000100`` for step 100 (eight digits, zero-padded)."""
    return f"step-{step:08d}"


def step_dir(root: str | Path, step: int) -> Location:
    """``root/step-XXXXXXXX`` in the root's own type (``Path`` on disk, a URI string on S3)."""
    store, root = located(root)
    return store.join(root, step_dir_name(step))


def list_step_dirs(root: str | Path) -> list[tuple[int, Location]]:
    """``(step, folder)`` of every ``step-*`` folder directly under ``root``, oldest first
    (valid or not)."""
    store, root = located(root)
    found = [(int(m.group(1)), store.join(root, name)) for name in store.list_dirs(root)
             if (m := _STEP_DIR.match(name))]
    return sorted(found)


# Manifests this process wrote, by location, with when (time.monotonic()): reading one of them
# back is reading what the product just wrote, so "missing" is the store's read-after-write lag
# (trainforge.storage.settle), not an incomplete checkpoint. The newest few are kept.
_WRITTEN: dict[str, float] = {}
_WRITTEN_KEPT = 64


def remember_written(manifest_at: Location) -> None:
    """Note that this process has just written the manifest at ``manifest_at``."""
    _WRITTEN[str(manifest_at)] = time.monotonic()
    for old in sorted(_WRITTEN, key=_WRITTEN.__getitem__)[:-_WRITTEN_KEPT]:
        del _WRITTEN[old]


def forget_written(manifest_at: Location) -> None:
    """Forget a manifest this process wrote (its folder is being deleted)."""
    _WRITTEN.pop(str(manifest_at), None)


def just_written(manifest_at: Location, written: bool | None) -> bool:
    """``written`` when given, else whether this process wrote the manifest at ``manifest_at``."""
    return written if written is not None else str(manifest_at) in _WRITTEN


def read_manifest(step_dir: str | Path, written: bool | None = None) -> dict[str, Any]:
    """The parsed manifest.json of a step folder.

    ``written``: the caller knows the product wrote this checkpoint (the trainer's final one,
    named in its result): a missing manifest is then read again for the store's read-after-write
    lag (:mod:`trainforge.storage.settle`). None (default): only when this process wrote it.

    Raises:
        CheckpointError: missing, unreadable, not JSON, or not a trainforge.checkpoint/v1 manifest.
    """
    store, step_dir = located(step_dir)
    where = store.join(step_dir, MANIFEST)
    waited_s = 0.0
    try:
        if just_written(where, written):
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
    store, step_dir = located(step_dir)
    fresh = just_written(store.join(step_dir, MANIFEST), written)
    try:
        manifest = read_manifest(step_dir, fresh)
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
        size = (size_written(store, where, "checkpoint file")[0] if fresh
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
