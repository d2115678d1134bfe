"""Checkpoints (docs/contracts.md, "Checkpoint layout"): write, verify, find, prune, load.

    <root>/step-00000100/
      model.safetensors   weights, each storage once (a tied lm_head is stored as the embedding)
      optimizer.pt        AdamW state_dict (torch.save; read back with weights_only=True)
      trainer_state.pt    {"step", "tokens_seen", "world_size", "scheduler": {"step"},
                           "rng": [per rank {"torch", "cuda", "numpy", "python"}]}
      meta.json           step, tokens_seen, world_size, digests, job config, versions, metrics
      manifest.json       written LAST, atomically: {"format", "step", "files": {name: {bytes, sha256}}}

A folder counts as a checkpoint only when `verify` finds no problem. ``step`` is the number of
optimizer steps completed; resuming from step-00000100 continues with step index 100.

Every function also takes an ``s3://bucket/prefix`` string for the root or the folder: the same
layout is then read and written on S3 (trainforge.trainer.checkpoint_s3: the manifest object is uploaded
last and is what makes a checkpoint exist). Paths (``pathlib.Path``) are always local.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from trainforge.trainer.errors import CheckpointError
from trainforge.trainer.fsutil import atomic_write_json, chmod_like_umask, fsync_dir, fsync_file
from trainforge.trainer.hashing import sha256_files

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "trainforge.checkpoint/v1"
MANIFEST = "manifest.json"
WEIGHTS, OPTIMIZER, TRAINER_STATE, META = "model.safetensors", "optimizer.pt", "trainer_state.pt", "meta.json"
REQUIRED_FILES = (WEIGHTS, OPTIMIZER, TRAINER_STATE, META)
# Written into a folder before it is moved aside (trainforge.trainer.quarantine): such a folder never verifies.
QUARANTINE_REASON = "QUARANTINE_REASON.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def _on_s3(path: Any) -> bool:
    """``s3://`` roots and folders go to trainforge.trainer.checkpoint_s3 (same layout, same rules)."""
    return isinstance(path, str) and path.startswith("s3://")


def join(root: str | Path, name: str) -> str:
    """``root/name`` as a string, keeping an ``s3://`` URI intact (``Path`` would eat a slash)."""
    if _on_s3(root):
        return f"{str(root).rstrip('/')}/{name}"
    return str(Path(root) / name)


def step_dir_name(step: int) -> str:
    """``step-00000100`` for step 100 (eight digits, zero-padded)."""
    return f"step-{step:08d}"


def list_step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-*`` folder under ``root``, oldest first (valid or not)."""
    if _on_s3(root):
        from trainforge.trainer import checkpoint_s3

        return checkpoint_s3.list_step_dirs(root)  # type: ignore[return-value]
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def read_manifest(step_dir: str | Path) -> dict[str, Any]:
    """The parsed manifest.json of a step folder.

    Raises:
        CheckpointError: missing, unreadable, not JSON, or not a trainforge.checkpoint/v1 manifest.
    """
    if _on_s3(step_dir):
        from trainforge.trainer import checkpoint_s3

        return checkpoint_s3.read_manifest(step_dir)
    path = Path(step_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a folder without a manifest is not a checkpoint)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{path}: format={got!r}, expected {CHECKPOINT_FORMAT!r}")
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"{path}: needs an integer 'step' and a 'files' object")
    return manifest


def verify(step_dir: str | Path, hashes: bool = True, max_threads: int | None = None) -> list[str]:
    """Every problem that stops ``step_dir`` from being a checkpoint; empty when it verifies.

    Checks the manifest (present, format, step = folder name, lists every required file), that
    the folder was not quarantined (`QUARANTINE_REASON` present), and each listed file's size
    and, when ``hashes``, SHA-256 (4 MiB reads; files hashed in parallel on up to
    ``max_threads`` threads, default one per file up to the usable cores: see trainforge.trainer.hashing).
    """
    if _on_s3(step_dir):
        from trainforge.trainer import checkpoint_s3

        return checkpoint_s3.verify(step_dir, hashes, max_threads)
    step_dir = Path(step_dir)
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as err:
        return [str(err)]
    problems = []
    m = _STEP_DIR.match(step_dir.name)
    if m is None or int(m.group(1)) != manifest["step"]:
        problems.append(f"{step_dir}: manifest step {manifest['step']} does not match the folder name")
    if (step_dir / QUARANTINE_REASON).exists():
        problems.append(f"{step_dir / QUARANTINE_REASON}: the checkpoint was quarantined; it is never resumed "
                        "from or registered")
    for name in REQUIRED_FILES:
        if name not in manifest["files"]:
            problems.append(f"{step_dir / MANIFEST}: does not list required file {name}")
    to_hash: dict[Path, str] = {}
    for name, entry in manifest["files"].items():
        path = step_dir / name
        if Path(name).name != name or not isinstance(entry, dict):
            problems.append(f"{step_dir / MANIFEST}: bad entry for {name!r}")
            continue
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{path}: listed in the manifest but missing")
            continue
        if size != entry.get("bytes"):
            problems.append(f"{path}: {size} bytes on disk, manifest says {entry.get('bytes')}")
        elif hashes:
            to_hash[path] = str(entry.get("sha256"))
    for path, got in sha256_files(list(to_hash), max_threads).items():
        if isinstance(got, OSError):
            problems.append(f"{path}: unreadable ({got.strerror or got})")
        elif got != to_hash[path]:
            problems.append(f"{path}: SHA-256 {got[:16]}... does not match the manifest's {to_hash[path][:16]}...")
    return problems


def newest_valid(root: str | Path) -> Path | None:
    """The newest step folder under ``root`` that verifies, or None. Logs the ones skipped.

    Only ``step-*`` folders directly under ``root`` are candidates: ``quarantine/`` is never
    looked into, and a folder holding a QUARANTINE_REASON.json never verifies. For an ``s3://``
    root the result is the step's URI string.
    """
    for step, path in reversed(list_step_dirs(root)):
        problems = verify(path)
        if not problems:
            return path
        log.warning("skipping %s: %s", path, "; ".join(problems))
    return None


def write_checkpoint(root: str | Path, step: int, weights: dict[str, torch.Tensor], optimizer_state: dict,
                     trainer_state: dict, meta: dict) -> Path:
    """Write ``root/step-XXXXXXXX/`` with the manifest last (rank 0 only).

    An existing folder of the same step is kept when it verifies (nothing is rewritten) and
    replaced otherwise (it is a partial write from a killed attempt).

    Args:
        weights: name -> contiguous CPU tensor, no two sharing storage.
    Raises:
        CheckpointError: a file could not be written (disk full, permissions).
    """
    if _on_s3(root):
        from trainforge.trainer import checkpoint_s3

        return checkpoint_s3.write_checkpoint(root, step, weights, optimizer_state, trainer_state, meta)  # type: ignore
    step_dir = Path(root) / step_dir_name(step)
    if step_dir.exists():
        if not verify(step_dir):
            log.info("checkpoint %s already exists and verifies; not rewriting it", step_dir)
            return step_dir
        log.warning("replacing incomplete checkpoint folder %s", step_dir)
        shutil.rmtree(step_dir)
    try:
        step_dir.mkdir(parents=True)
        safetensors.torch.save_file(weights, step_dir / WEIGHTS, metadata={"format": "pt"})
        chmod_like_umask(step_dir / WEIGHTS)
        torch.save(optimizer_state, step_dir / OPTIMIZER)
        torch.save(trainer_state, step_dir / TRAINER_STATE)
        (step_dir / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        for name in REQUIRED_FILES:
            fsync_file(step_dir / name)
        digests = sha256_files([step_dir / name for name in REQUIRED_FILES])  # what is on disk, after fsync
        files = {}
        for name in REQUIRED_FILES:
            digest = digests[step_dir / name]
            if isinstance(digest, OSError):
                raise digest
            files[name] = {"bytes": (step_dir / name).stat().st_size, "sha256": digest}
        atomic_write_json(step_dir / MANIFEST, {"format": CHECKPOINT_FORMAT, "step": step, "files": files})
        fsync_dir(step_dir.parent)
    except OSError as err:
        raise CheckpointError(f"writing checkpoint {step_dir} failed: {err}") from err
    return step_dir


def apply_retention(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` valid checkpoints; returns the folders deleted.

    Also deletes folders that do not verify when they are older than the newest valid one
    (partial writes of killed attempts). Never deletes the newest valid checkpoint, nor
    anything newer than it (it may be a write in progress).
    """
    if _on_s3(root):
        from trainforge.trainer import checkpoint_s3

        return checkpoint_s3.apply_retention(root, keep_last)  # type: ignore[return-value]
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: expected >= 1")
    dirs = list_step_dirs(root)
    valid = [(s, p) for s, p in reversed(dirs) if not verify(p)]  # newest first
    if not valid:
        return []
    newest_step = valid[0][0]
    keep = {p for _, p in valid[:keep_last]}
    doomed = [p for s, p in dirs if p not in keep and s < newest_step]
    for path in doomed:
        log.info("retention (keep_last=%d): deleting %s", keep_last, path)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


@dataclass
class Checkpoint:
    path: Path
    step: int
    weights: dict[str, torch.Tensor]  # as written: no tied aliases
    optimizer: dict[str, Any]
    trainer_state: dict[str, Any]
    meta: dict[str, Any]


def load_checkpoint(step_dir: str | Path) -> Checkpoint:
    """Read every file of a checkpoint onto the CPU without unpickling arbitrary objects.

    Does not verify hashes (call `verify` first; resume picks folders that verified).

    Raises:
        CheckpointError: a file is missing or cannot be decoded.
    """
    if _on_s3(step_dir):
        from trainforge.trainer import checkpoint_s3

        return checkpoint_s3.load_checkpoint(step_dir)
    step_dir = Path(step_dir)
    try:
        weights = safetensors.torch.load_file(step_dir / WEIGHTS, device="cpu")
        optimizer = torch.load(step_dir / OPTIMIZER, map_location="cpu", weights_only=True)
        state = torch.load(step_dir / TRAINER_STATE, map_location="cpu", weights_only=True)
        meta = json.loads((step_dir / META).read_text(encoding="utf-8"))
    except Exception as err:  # safetensors, pickle and JSON each raise their own types
        raise CheckpointError(f"loading checkpoint {step_dir} failed: {type(err).__name__}: {err}") from err
    return Checkpoint(step_dir, int(state["step"]), weights, optimizer, state, meta)


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

