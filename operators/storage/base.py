"""The storage interface (a Protocol both implementations satisfy) and its error."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

Location = Path | str
"""A file or folder: a ``Path`` on the local disk, an ``s3://bucket/key`` string on S3."""


class StorageError(Exception):
    """A storage call failed (on S3: after botocore's retries). Transient for the trainer.

    Attributes:
        location, operation, cause: what failed, how, and the store's answer.
        throttled: how many answers of the call were throttling (S3 ``503 SlowDown``, ``429``);
            0 when the call failed otherwise.
        remedy: what to do about it, when the cause tells (empty otherwise; callers may then
            add their own).
    """

    def __init__(self, location: str, operation: str, cause: str, throttled: int = 0,
                 remedy: str = "") -> None:
        self.location, self.operation, self.cause = location, operation, cause
        self.throttled, self.remedy = throttled, remedy
        text = (f"S3 {operation} {location} failed: {cause}" if location.startswith("s3://")
                else f"{operation} {location} failed: {cause}")
        super().__init__(f"{text}; {remedy}" if remedy else text)


class Storage(Protocol):
    """Files in folders, on the local disk or under an S3 prefix.

    A "folder" on S3 is a key prefix ending in ``/``; it exists while an object is under it.
    Every method raises `StorageError` when the store cannot be reached or refuses the call; a
    missing file is an answer (``None`` / ``False`` / empty), not an error.

    ``settle_s``: how long a file this product has just written may take to become readable
    (seconds): 0 on the local disk; on S3, whose compatible stores may answer 404 for seconds
    after a PUT, :data:`trainforge.storage.s3.SETTLE_S`. Used only by
    :mod:`trainforge.storage.settle`, for files the product itself wrote.
    """

    settle_s: float

    def join(self, base: Location, *names: str) -> Location:
        """``base/name/...`` (``base`` may end with ``/``)."""

    def name(self, location: Location) -> str:
        """The last path segment (``step-00000100`` of ``.../step-00000100/``)."""

    def parent(self, location: Location) -> Location:
        """The folder holding ``location``."""

    def absolute(self, location: Location) -> str:
        """How reports and logs name ``location``: a resolved path, or the URI."""

    def local_path(self, location: Location) -> Path | None:
        """``location`` as a local path, or None when it is not on this machine's disk."""

    def list_dirs(self, location: Location) -> list[str]:
        """Names of the folders directly under ``location``, sorted; empty when there is none."""

    def list_files(self, location: Location) -> list[str]:
        """Names of the files directly under ``location``, sorted; empty when there is none."""

    def is_dir(self, location: Location) -> bool:
        """Whether the folder exists (on S3: any object under it)."""

    def size(self, location: Location) -> int | None:
        """The file's size in bytes, or None when it does not exist."""

    def read_bytes(self, location: Location) -> bytes | None:
        """The whole file, or None when it does not exist."""

    def sha256(self, location: Location) -> str:
        """SHA-256 hex of the file, streamed in 4 MiB reads."""

    def write_bytes(self, location: Location, data: bytes) -> None:
        """Write atomically: a reader sees the old file or the whole new one, never a part."""

    def put_file(self, path: Path, location: Location) -> None:
        """Store the local file ``path`` as ``location`` (on S3 multipart above 8 MiB)."""

    def get_file(self, location: Location, path: Path) -> None:
        """Copy ``location`` into the local file ``path``."""

    def staging_dir(self, location: Location) -> AbstractContextManager[Path]:
        """A local folder to write ``location``'s files into before `publish`: the folder itself
        (created) on disk, a temporary folder for S3."""

    def publish(self, folder: Path, location: Location, names: Sequence[str]) -> None:
        """Make ``folder/<name>`` durable as ``location/<name>``, in order (fsync on disk, upload
        on S3). The caller writes its commit marker afterwards with `write_bytes`."""

    def local_dir(self, location: Location, names: Sequence[str]) -> AbstractContextManager[Path]:
        """The folder as a local folder of the same name holding (at least) ``names``: the
        folder itself on disk; on S3 a temporary download of those of ``names`` that exist."""

    def move_dir(self, src: Location, dst: Location, first: str) -> None:
        """Move a folder; on S3 (copy, then delete) the file ``first`` of ``src`` goes first."""

    def delete_dir(self, location: Location, first: str) -> int:
        """Delete a folder and everything in it, the file ``first`` before the rest (a reader
        then never sees ``first`` beside a partial folder); returns how many files went."""
