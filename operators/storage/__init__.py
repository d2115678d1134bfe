"""Where the trainer and data preparation keep their files: one interface over a local folder
and an ``s3://bucket/prefix``.

Checkpoints (:mod:`trainforge.trainer.checkpoint`), datasets read by the trainer
(:mod:`trainforge.trainer.data`) and prepared datasets written by data preparation
(:mod:`trainforge.data.remote`) go through a :class:`~trainforge.storage.base.Storage` chosen by
:func:`storage_for` from the location, so their code reads the same on disk and on S3:

* :class:`~trainforge.storage.local.LocalStorage`: folders; atomic writes are a temporary file
  renamed into place; locations are ``pathlib.Path``.
* :class:`~trainforge.storage.s3.S3Storage`: objects under a prefix; a single PutObject is atomic;
  locations are ``s3://`` strings. boto3 is imported on first use, with bounded timeouts and
  retries (:mod:`trainforge.storage.s3`); credentials only from boto3's standard chain or a
  session the caller hands in (an Airflow connection's, on the Airflow side).

This package imports neither Airflow nor torch: the trainer and the Airflow side both use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from trainforge.storage.base import Location, Storage, StorageError
from trainforge.storage.local import LocalStorage
from trainforge.storage.s3 import S3Storage, is_s3

__all__ = ["LocalStorage", "Location", "S3Storage", "Storage", "StorageError", "is_s3", "storage_for"]


def storage_for(location: str | os.PathLike[str], s3_client: Callable[[], Any] | None = None) -> Storage:
    """The storage holding ``location``: S3 for ``s3://...`` strings, else the local disk.

    ``s3_client``: returns the boto3 S3 client to use, called on first use (default: this
    process's client for the endpoint in the environment, :func:`trainforge.storage.s3.client`).
    """
    if is_s3(location):
        return S3Storage(s3_client) if s3_client is not None else S3Storage()
    return LocalStorage()
