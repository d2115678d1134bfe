"""Folders on the local disk (or a shared file system) behind the storage interface.

Writes that must be atomic go to ``<name>.tmp-<pid>`` first and are renamed into place with the
file and its folder fsync'ed (:func:`trainforge.storage.files.atomic_write_bytes`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from trainforge.storage.base import Location, StorageError
from trainforge.storage.files import atomic_write_bytes, fsync_dir, fsync_file, sha256_file


def _error(location: Location, operation: str, err: OSError) -> StorageError:
    return StorageError(str(location), operation, err.strerror or str(err))


class LocalStorage:
    """`trainforge.storage.base.Storage` on the local disk; locations are ``Path`` objects."""

    settle_s = 0.0  # a file written (and renamed into place) is readable at once

    def join(self, base: Location, *names: str) -> Path:
        return Path(base).joinpath(*names)

    def name(self, location: Location) -> str:
        return Path(location).name

    def parent(self, location: Location) -> Path:
        return Path(location).parent

    def absolute(self, location: Location) -> str:
        return str(Path(location).resolve())

    def local_path(self, location: Location) -> Path:
        return Path(location)

    def list_dirs(self, location: Location) -> list[str]:
        root = Path(location)
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def list_files(self, location: Location) -> list[str]:
        root = Path(location)
        return sorted(p.name for p in root.iterdir() if p.is_file()) if root.is_dir() else []

    def is_dir(self, location: Location) -> bool:
        return Path(location).is_dir()

    def size(self, location: Location) -> int | None:
        try:
            return Path(location).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as err:
            raise _error(location, "stat", err) from err

    def read_bytes(self, location: Location) -> bytes | None:
        try:
            return Path(location).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise _error(location, "read", err) from err

    def sha256(self, location: Location) -> str:
        try:
            return sha256_file(location)
        except OSError as err:
            raise _error(location, "read", err) from err

    def write_bytes(self, location: Location, data: bytes) -> None:
        try:
            atomic_write_bytes(location, data)
        except OSError as err:
            raise _error(location, "write", err) from err

    def put_file(self, path: Path, location: Location) -> None:
        target = Path(location)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp)
            fsync_file(tmp)
            os.replace(tmp, target)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise _error(location, "copy to", err) from err

    def get_file(self, location: Location, path: Path) -> None:
        try:
            shutil.copyfile(location, path)
        except OSError as err:
            raise _error(location, "copy", err) from err

    @contextmanager
    def staging_dir(self, location: Location) -> Iterator[Path]:
        folder = Path(location)
        try:
            folder.mkdir(parents=True)
        except OSError as err:
            raise _error(location, "create", err) from err
        yield folder

    def publish(self, folder: Path, location: Location, names: Sequence[str]) -> None:
        try:
            for name in names:
                fsync_file(folder / name)
            fsync_dir(folder.parent)
        except OSError as err:
            raise _error(location, "fsync", err) from err

    @contextmanager
    def local_dir(self, location: Location, names: Sequence[str]) -> Iterator[Path]:
        yield Path(location)

    def move_dir(self, src: Location, dst: Location, first: str) -> None:
        """``os.rename`` (atomic on one file system, so ``first`` needs no special order)."""
        src, dst = Path(src), Path(dst)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, dst)
            fsync_dir(src.parent)
            fsync_dir(dst.parent)
        except OSError as err:
            raise _error(src, f"move to {dst}:", err) from err

    def delete_dir(self, location: Location, first: str) -> int:
        folder = Path(location)
        count = sum(1 for p in folder.rglob("*") if p.is_file())
        (folder / first).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        return count
