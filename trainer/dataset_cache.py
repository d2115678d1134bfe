"""Datasets that are not on this machine's disk (an S3 prefix): a local cache, keyed by the
dataset digest, that a trainer can memory-map.

``s3://bucket/prefix/<digest>/`` holds the same files as a local dataset folder and, like it,
exists only once its ``manifest.json`` object is there (prepare_data uploads it last). A trainer
pod or Ray worker has no copy of it, so `cached_dataset` downloads it once per machine:

    <cache>/<digest>/                   a finished copy: every file the manifest lists, then it
    <cache>/.<digest>.tmp-<pid>-<hex>/  a download in progress (never read)
    <cache>/.<digest>.lock              held while one process checks or downloads

The files go into the temporary folder, are checked against the manifest (size, SHA-256, token
ids < vocab_size: `trainforge.trainer.dataset.read_dataset`) and only then is the folder renamed to
``<digest>/``, so a half-downloaded or damaged copy is never used. A cached copy that no longer
verifies is deleted and downloaded again. Several ranks on one machine share one download (the
lock). The cache folder is ``TRAINFORGE_DATASET_CACHE``, else ``$TRAINFORGE_HOME/cache/datasets``,
else ``~/.cache/trainforge/datasets``.

Reads go through the storage interface (trainforge.storage; on S3: boto3's standard chain,
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for an S3-compatible store).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainforge.contract import dataset_files
from trainforge.storage import Storage
from trainforge.storage.settle import read_written, size_written
from trainforge.trainer.dataset import MANIFEST, Dataset, read_dataset
from trainforge.trainer.errors import DatasetError

log = logging.getLogger(__name__)

#: Parallel object downloads (each one multipart above trainforge.storage.s3.MULTIPART_BYTES).
DOWNLOAD_THREADS = 4
_DIGEST = re.compile(r"^[0-9a-f]{16,128}$")


def cache_root() -> Path:
    """Where datasets downloaded from S3 are kept on this machine (module doc)."""
    explicit = os.environ.get("TRAINFORGE_DATASET_CACHE")
    if explicit:
        return Path(explicit).expanduser().absolute()
    home = os.environ.get("TRAINFORGE_HOME")
    if home:
        return Path(home).expanduser().absolute() / "cache" / "datasets"
    return Path.home() / ".cache" / "trainforge" / "datasets"


def listed_files(manifest: dict[str, Any], where: str) -> list[str]:
    """Every file name a dataset manifest lists (tokenizer, shards, indexes), manifest excluded.

    Raises:
        DatasetError: the manifest lacks the tokenizer or splits, or names a file outside the folder.
    """
    try:
        names = dataset_files(manifest)
    except (KeyError, TypeError, AttributeError) as err:
        raise DatasetError(f"{where}: no tokenizer file or split shards listed ({err!r})") from err
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise DatasetError(f"{where}: file {name!r} must be a plain file name inside the dataset")
    return names


def _read_manifest(store: Storage, uri: str) -> tuple[bytes, dict[str, Any], str]:
    # The dataset is prepare_data's output, uploaded (manifest last) before the trainer was
    # launched: a missing manifest may be the store's read-after-write lag, so it is read again
    # for up to the store's settle_s (trainforge.storage.settle) before it counts as missing.
    manifest_uri = store.join(uri, MANIFEST)
    data, waited_s = read_written(store, manifest_uri, "dataset manifest")
    if data is None:
        lag = f" (still missing after waiting {waited_s:.1f} s for the store)" if waited_s else ""
        raise DatasetError(f"{manifest_uri}: missing{lag}; a dataset without a manifest does not "
                           "exist (was prepare_data's upload interrupted?)")
    try:
        manifest = json.loads(data)
    except ValueError as err:
        raise DatasetError(f"{manifest_uri}: unreadable ({err})") from err
    digest = manifest.get("digest") if isinstance(manifest, dict) else None
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise DatasetError(f"{manifest_uri}: digest={digest!r}, expected a lower-case hex SHA-256")
    return data, manifest, digest


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_dataset(store: Storage, uri: str, verify_hashes: bool = True) -> Dataset:
    """Open the dataset ``uri`` of ``store`` from this machine's cache, downloading it first when
    needed.

    Returns:
        The Dataset of the local copy ``<cache>/<digest>/`` (checked: the fresh download
        always with SHA-256s; a cached copy with them when ``verify_hashes``).
    Raises:
        DatasetError: no manifest on S3, or the downloaded files do not match it (exit code 78).
        StorageError: S3 could not be read after botocore's retries (transient: the task retries).
    """
    manifest_bytes, manifest, digest = _read_manifest(store, uri)
    root = cache_root()
    target = root / digest
    with _locked(root / f".{digest}.lock"):
        if target.is_dir():
            same = (target / MANIFEST).is_file() and (target / MANIFEST).read_bytes() == manifest_bytes
            if same:
                try:
                    dataset = read_dataset(target, verify_hashes)
                    log.info("dataset %s: using the cached copy %s", uri, target)
                    return dataset
                except DatasetError as err:
                    log.warning("cached copy %s of %s does not verify (%s): downloading it again",
                                target, uri, err)
            else:
                log.warning("cached copy %s has another manifest than %s: downloading it again", target, uri)
            shutil.rmtree(target)
        _download(store, uri, manifest_bytes, manifest, target)
        return read_dataset(target, verify_hashes=False)  # the bytes were hashed just before the rename


def _download(store: Storage, uri: str, manifest_bytes: bytes, manifest: dict[str, Any],
              target: Path) -> None:
    """Download every listed file into a temporary sibling of ``target``, verify, rename."""
    names = listed_files(manifest, str(store.join(uri, MANIFEST)))
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        log.info("dataset %s: downloading %d files into %s", uri, len(names), target)
        for name in names:  # uploaded before the manifest: visible, or the store lags
            size_written(store, store.join(uri, name), "dataset file")
        with ThreadPoolExecutor(min(DOWNLOAD_THREADS, len(names))) as pool:
            list(pool.map(lambda n: store.get_file(store.join(uri, n), tmp / n), names))
        (tmp / MANIFEST).write_bytes(manifest_bytes)  # last, as on S3
        try:
            read_dataset(tmp, verify_hashes=True)
        except DatasetError as err:
            raise DatasetError(f"dataset {uri} does not match its manifest once downloaded: {err}") from None
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
