"""An ``s3://`` output root: prepare locally, upload with the manifest last, or reuse.

``s3://bucket/prefix/<digest>/`` holds the same files as a local dataset folder. Like a local
one, it exists only once its ``manifest.json`` is there: files are uploaded first, the manifest
last, so an interrupted upload leaves no dataset a later run or a trainer could take for a
finished one (the next run uploads again).

The local copy under ``staging_root/<digest>/`` is what a trainer on this machine reads
(``dataset_dir``); ``dataset_uri`` names the S3 copy.

1. The S3 manifest exists: reuse. If the local copy has the same manifest and verifies, nothing
   moves; else every file is downloaded into a temporary folder, verified and renamed into place.
2. Else prepare (or reuse) the local copy, upload every file it lists, then the manifest.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainforge.data import s3
from trainforge.data.errors import DatasetInvalidError
from trainforge.data.manifest import (
    MANIFEST_NAME, dataset_files, load_manifest, verify_dataset,
)
from trainforge.data.prepare import PreparedDataset

logger = logging.getLogger(__name__)


def prepare_remote(output_root: str, staging_root: Path, digest: str,
                   build: Callable[[Path], PreparedDataset], client: Any, started: float,
                   log: logging.Logger | logging.LoggerAdapter = logger) -> PreparedDataset:
    """Make ``output_root/<digest>/`` exist on S3 and locally (see the module doc).

    Raises:
        SourceAccessError: S3 cannot be read or written.
        DatasetInvalidError: the S3 copy does not verify once downloaded.
    """
    remote_dir = f"{output_root.rstrip('/')}/{digest}"
    manifest_uri = f"{remote_dir}/{MANIFEST_NAME}"
    local = staging_root / digest
    if s3.exists(client, manifest_uri):
        remote_manifest = s3.read_bytes(client, manifest_uri)
        local_manifest = local / MANIFEST_NAME
        if (local_manifest.is_file() and local_manifest.read_bytes() == remote_manifest
                and not verify_dataset(local)):
            log.info("dataset %s already on %s and in %s; reusing both", digest[:12],
                     remote_dir, local)
        else:
            log.info("dataset %s already on %s; downloading it to %s", digest[:12], remote_dir,
                     local)
            _download(client, remote_dir, remote_manifest, local, digest)
        return PreparedDataset(local, digest, load_manifest(local), True,
                               time.monotonic() - started, uri=remote_dir, reuse="remote")
    prepared = build(staging_root)
    upload_started = time.monotonic()
    files = dataset_files(prepared.manifest)
    for name in files:
        s3.upload_file(client, str(prepared.path / name), f"{remote_dir}/{name}")
    s3.upload_file(client, str(prepared.path / MANIFEST_NAME), manifest_uri)  # last
    upload_s = time.monotonic() - upload_started
    log.info("uploaded dataset %s to %s (%d files, manifest last) in %.1f s", digest[:12],
             remote_dir, len(files) + 1, upload_s)
    return PreparedDataset(prepared.path, digest, prepared.manifest, prepared.reused,
                           time.monotonic() - started, uri=remote_dir, reuse=prepared.reuse,
                           timings_s={**prepared.timings_s, "upload": upload_s})


def _download(client: Any, remote_dir: str, manifest_bytes: bytes, local: Path,
              digest: str) -> None:
    import json

    manifest = json.loads(manifest_bytes)
    local.parent.mkdir(parents=True, exist_ok=True)
    work = local.with_name(f".{digest}.download-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        for name in dataset_files(manifest):
            if Path(name).name != name:
                raise DatasetInvalidError(remote_dir, [f"file {name!r} is not a plain name"])
            s3.download_file(client, f"{remote_dir}/{name}", str(work / name))
        (work / MANIFEST_NAME).write_bytes(manifest_bytes)  # last; byte-identical to S3's
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
