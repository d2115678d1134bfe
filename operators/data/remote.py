"""An output root that is not a local folder (``s3://``): prepare locally, upload with the
manifest last, or reuse.

``<output_root>/<digest>/`` holds the same files as a local dataset folder. Like a local one, it
exists only once its ``manifest.json`` is there: files are uploaded first, the manifest last
(:meth:`trainforge.storage.base.Storage.publish`, then one atomic write), so an interrupted
upload leaves no dataset a later run or a trainer could take for a finished one (the next run
uploads again).

The local copy under ``staging_root/<digest>/`` is what a trainer on this machine reads
(``dataset_dir``); ``dataset_uri`` names the remote copy.

1. The remote manifest exists: reuse. If the local copy has the same manifest and verifies,
   nothing moves; else every file is downloaded into a temporary folder, verified and renamed
   into place.
2. Else prepare (or reuse) the local copy, upload every file it lists, then the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from trainforge.contract import dataset_files
from trainforge.data.errors import DatasetInvalidError, SourceAccessError
from trainforge.data.manifest import MANIFEST_NAME, load_manifest, verify_dataset
from trainforge.data.result import PreparedDataset
from trainforge.storage import Storage, StorageError

logger = logging.getLogger(__name__)


def prepare_remote(output: Storage, output_root: str, staging_root: Path, digest: str,
                   build: Callable[[Path], PreparedDataset], started: float,
                   log: logging.Logger | logging.LoggerAdapter = logger) -> PreparedDataset:
    """Make ``output_root/<digest>/`` exist on ``output`` and locally (see the module doc).

    Raises:
        SourceAccessError: the output storage cannot be read or written.
        DatasetInvalidError: the remote copy does not verify once downloaded.
    """
    remote_dir = str(output.join(output_root, digest))
    try:
        return _prepare_remote(output, remote_dir, staging_root, digest, build, started, log)
    except StorageError as err:
        raise SourceAccessError(err.location, err.operation, err.cause, remedy=err.remedy) from err


def _prepare_remote(output: Storage, remote_dir: str, staging_root: Path, digest: str,
                    build: Callable[[Path], PreparedDataset], started: float,
                    log: logging.Logger | logging.LoggerAdapter) -> PreparedDataset:
    manifest_at = output.join(remote_dir, MANIFEST_NAME)
    local = staging_root / digest
    remote_manifest = output.read_bytes(manifest_at)
    if remote_manifest is not None:
        local_manifest = local / MANIFEST_NAME
        if (local_manifest.is_file() and local_manifest.read_bytes() == remote_manifest
                and not verify_dataset(local)):
            log.info("dataset %s already on %s and in %s; reusing both", digest[:12],
                     remote_dir, local)
        else:
            log.info("dataset %s already on %s; downloading it to %s", digest[:12], remote_dir,
                     local)
            _download(output, remote_dir, remote_manifest, local, digest)
        return PreparedDataset(local, digest, load_manifest(local), True,
                               time.monotonic() - started, uri=remote_dir, reuse="remote")
    prepared = build(staging_root)
    upload_started = time.monotonic()
    files = dataset_files(prepared.manifest)
    output.publish(prepared.path, remote_dir, files)
    output.write_bytes(manifest_at, (prepared.path / MANIFEST_NAME).read_bytes())  # last
    upload_s = time.monotonic() - upload_started
    log.info("uploaded dataset %s to %s (%d files, manifest last) in %.1f s", digest[:12],
             remote_dir, len(files) + 1, upload_s)
    return PreparedDataset(prepared.path, digest, prepared.manifest, prepared.reused,
                           time.monotonic() - started, uri=remote_dir, reuse=prepared.reuse,
                           timings_s={**prepared.timings_s, "upload": upload_s})


def _download(output: Storage, remote_dir: str, manifest_bytes: bytes, local: Path,
              digest: str) -> None:
    manifest = json.loads(manifest_bytes)
    local.parent.mkdir(parents=True, exist_ok=True)
    work = local.with_name(f".{digest}.download-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        for name in dataset_files(manifest):
            if Path(name).name != name:
                raise DatasetInvalidError(remote_dir, [f"file {name!r} is not a plain name"])
            output.get_file(output.join(remote_dir, name), work / name)
        (work / MANIFEST_NAME).write_bytes(manifest_bytes)  # last; byte-identical to the remote
        problems = verify_dataset(work)
        if problems:
            raise DatasetInvalidError(remote_dir, problems)
        if local.exists():
            broken = local.with_name(f".{digest}.broken-{os.getpid()}")
            os.replace(local, broken)
            shutil.rmtree(broken, ignore_errors=True)
        os.replace(work, local)
    finally:
        shutil.rmtree(work, ignore_errors=True)
