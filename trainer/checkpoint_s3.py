"""Checkpoints on S3: the local layout (trainforge.trainer.checkpoint) under ``s3://bucket/prefix/``.

    s3://bucket/<root>/step-00000100/{model.safetensors, optimizer.pt, trainer_state.pt, meta.json}
    s3://bucket/<root>/step-00000100/manifest.json      uploaded LAST: it makes the checkpoint exist

S3 has no rename, so the commit point is the manifest object: the files are written to a local
staging folder exactly as on disk, uploaded (multipart, retried: trainforge.trainer.s3), and only then is
``manifest.json`` put, in one PutObject. A reader that sees the manifest sees every file it lists;
an attempt killed mid-upload leaves objects without a manifest, which are not a checkpoint.
Rewriting a step whose manifest does not verify deletes that manifest first.

`trainforge.trainer.checkpoint`'s functions call these when their root or folder is an ``s3://`` string;
callers never need to import this module.
"""

from __future__ import annotations

import json
import logging
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer import s3
from trainforge.trainer.errors import CheckpointError
from trainforge.trainer.hashing import hash_threads

log = logging.getLogger(__name__)


def list_step_dirs(root: str) -> list[tuple[int, str]]:
    """``(step, uri)`` of every ``step-*`` prefix directly under ``root``, oldest first."""
    found = []
    for name in s3.list_children(root):
        m = ckpt._STEP_DIR.match(name)
        if m:
            found.append((int(m.group(1)), s3.join(root, name)))
    return sorted(found)


def read_manifest(step_uri: str) -> dict[str, Any]:
    """The parsed manifest of a step prefix. Raises CheckpointError like the local version."""
    uri = s3.join(step_uri, ckpt.MANIFEST)
    data = s3.get_bytes(uri)
    if data is None:
        raise CheckpointError(f"{uri}: missing (a folder without a manifest is not a checkpoint)")
    try:
        manifest = json.loads(data)
    except ValueError as err:
        raise CheckpointError(f"{uri}: unreadable ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != ckpt.CHECKPOINT_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{uri}: format={got!r}, expected {ckpt.CHECKPOINT_FORMAT!r}")
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"{uri}: needs an integer 'step' and a 'files' object")
    return manifest


def verify(step_uri: str, hashes: bool = True, max_threads: int | None = None) -> list[str]:
    """Every problem that stops ``step_uri`` from being a checkpoint (same rules as local);
    objects are hashed as they stream, several at once."""
    try:
        manifest = read_manifest(step_uri)
    except CheckpointError as err:
        return [str(err)]
    problems = []
    name = step_uri.rstrip("/").rsplit("/", 1)[-1]
    m = ckpt._STEP_DIR.match(name)
    if m is None or int(m.group(1)) != manifest["step"]:
        problems.append(f"{step_uri}: manifest step {manifest['step']} does not match the folder name")
    if s3.size_of(s3.join(step_uri, ckpt.QUARANTINE_REASON)) is not None:
        problems.append(f"{s3.join(step_uri, ckpt.QUARANTINE_REASON)}: the checkpoint was quarantined")
    problems += [f"{step_uri}/{ckpt.MANIFEST}: does not list required file {n}"
                 for n in ckpt.REQUIRED_FILES if n not in manifest["files"]]
    to_hash = {}
    for file_name, entry in manifest["files"].items():
        uri = s3.join(step_uri, file_name)
        if Path(file_name).name != file_name or not isinstance(entry, dict):
            problems.append(f"{step_uri}/{ckpt.MANIFEST}: bad entry for {file_name!r}")
            continue
        size = s3.size_of(uri)
        if size is None:
            problems.append(f"{uri}: listed in the manifest but missing")
        elif size != entry.get("bytes"):
            problems.append(f"{uri}: {size} bytes stored, manifest says {entry.get('bytes')}")
        elif hashes:
            to_hash[uri] = str(entry.get("sha256"))
    if to_hash:
        with ThreadPoolExecutor(hash_threads(len(to_hash), max_threads)) as pool:
            digests = dict(zip(to_hash, pool.map(_safe_sha256, to_hash)))
        for uri, got in digests.items():
            if got != to_hash[uri]:
                problems.append(f"{uri}: SHA-256 {got[:16]}... does not match the manifest's {to_hash[uri][:16]}...")
    return problems


def _safe_sha256(uri: str) -> str:
    try:
        return s3.sha256(uri)
    except s3.S3Error as err:
        return f"unreadable ({err.cause})"


def write_checkpoint(root: str, step: int, weights, optimizer_state: dict, trainer_state: dict,
                     meta: dict) -> str:
    """Write ``root/step-XXXXXXXX/`` on S3 with the manifest last; returns its URI.

    A step that already verifies is kept as it is; one whose manifest does not verify loses
    that manifest first (it stops existing), then is rewritten.

    Raises:
        CheckpointError: staging or an upload failed (S3Error after botocore's retries).
    """
    step_uri = s3.join(root, ckpt.step_dir_name(step))
    if s3.size_of(s3.join(step_uri, ckpt.MANIFEST)) is not None:
        if not verify(step_uri):
            log.info("checkpoint %s already exists and verifies; not rewriting it", step_uri)
            return step_uri
        log.warning("replacing incomplete checkpoint %s (its manifest first)", step_uri)
        s3.delete_keys(step_uri, [s3.split(s3.join(step_uri, ckpt.MANIFEST))[1]])
    with tempfile.TemporaryDirectory(prefix="trainforge-ckpt-") as tmp:
        local = ckpt.write_checkpoint(tmp, step, weights, optimizer_state, trainer_state, meta)
        for name in ckpt.REQUIRED_FILES:
            s3.upload_file(local / name, s3.join(step_uri, name))
        s3.put_bytes(s3.join(step_uri, ckpt.MANIFEST), (local / ckpt.MANIFEST).read_bytes())  # commit
    return step_uri


def apply_retention(root: str, keep_last: int) -> list[str]:
    """`trainforge.trainer.checkpoint.apply_retention` on S3 (same rules); returns the prefixes deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: expected >= 1")
    dirs = list_step_dirs(root)
    valid = [(s, u) for s, u in reversed(dirs) if not verify(u)]
    if not valid:
        return []
    keep = {u for _, u in valid[:keep_last]}
    doomed = [u for s, u in dirs if u not in keep and s < valid[0][0]]
    for uri in doomed:
        log.info("retention (keep_last=%d): deleting %s", keep_last, uri)
        manifest = s3.split(s3.join(uri, ckpt.MANIFEST))[1]
        s3.delete_keys(uri, [manifest])  # stops existing first, then the rest goes
        s3.delete_prefix(uri)
    return doomed


def fetch(step_uri: str, dest: str | Path) -> Path:
    """Download the manifest and every file it lists into ``dest/<step-name>/``; returns it.

    Nothing is verified here: `trainforge.trainer.checkpoint.verify` the local copy (same bytes).

    Raises:
        CheckpointError: no readable manifest, or a download failed.
    """
    manifest = read_manifest(step_uri)
    local = Path(dest) / step_uri.rstrip("/").rsplit("/", 1)[-1]
    local.mkdir(parents=True, exist_ok=True)
    for name in manifest["files"]:
        if Path(name).name == name and s3.size_of(s3.join(step_uri, name)) is not None:
            s3.download_file(s3.join(step_uri, name), local / name)
    if s3.size_of(s3.join(step_uri, ckpt.QUARANTINE_REASON)) is not None:  # so the copy refuses too
        s3.download_file(s3.join(step_uri, ckpt.QUARANTINE_REASON), local / ckpt.QUARANTINE_REASON)
    s3.download_file(s3.join(step_uri, ckpt.MANIFEST), local / ckpt.MANIFEST)
    return local


def load_checkpoint(step_uri: str) -> ckpt.Checkpoint:
    """`trainforge.trainer.checkpoint.load_checkpoint` of an S3 step (downloaded to a temporary folder)."""
    with tempfile.TemporaryDirectory(prefix="trainforge-load-") as tmp:
        loaded = ckpt.load_checkpoint(fetch(step_uri, tmp))
    loaded.path = step_uri  # type: ignore[assignment]
    return loaded


def quarantine(step_uri: str, reasons: list[str], failed_checks: list[str] = (), step: int | None = None,
               by: str = "trainforge.trainer.validate") -> str:
    """Move ``step_uri`` to ``<root>/quarantine/<name>[.N]/`` on S3 with a QUARANTINE_REASON.json.

    The reason object is written into the step prefix first (it then never verifies), every
    object is copied, and the originals are deleted manifest first. Returns the new prefix.
    """
    root, name = step_uri.rstrip("/").rsplit("/", 1)
    reason = {"format": "trainforge.quarantine/v1", "checkpoint": step_uri, "step": step,
              "quarantined_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "reasons": list(reasons), "failed_checks": list(failed_checks), "by": by}
    s3.put_bytes(s3.join(step_uri, ckpt.QUARANTINE_REASON), (json.dumps(reason, indent=2) + "\n").encode())
    taken = set(s3.list_children(s3.join(root, "quarantine")))
    target_name, n = name, 0
    while target_name in taken:
        n += 1
        target_name = f"{name}.{n}"
    target = s3.join(root, "quarantine", target_name)
    bucket, prefix = s3.split(step_uri.rstrip("/") + "/")
    keys = list(s3.list_keys(step_uri.rstrip("/") + "/"))
    for key in keys:
        s3.copy(f"s3://{bucket}/{key}", s3.join(target, key[len(prefix):]))
    manifest_key = prefix + ckpt.MANIFEST
    s3.delete_keys(step_uri, [k for k in keys if k == manifest_key])
    s3.delete_keys(step_uri, [k for k in keys if k != manifest_key])
    log.warning("quarantined %s -> %s: %s", step_uri, target, "; ".join(reasons))
    return target
