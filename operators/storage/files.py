"""Small file helpers: chunked SHA-256, fsync'ed and atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

HASH_CHUNK_BYTES = 4 << 20  # 4 MiB reads: large enough that hashing is disk-bound, not call-bound


def sha256_file(path: str | Path, chunk_bytes: int = HASH_CHUNK_BYTES) -> str:
    """SHA-256 hex digest of a file, read in ``chunk_bytes`` chunks (4 MiB by default).

    Raises:
        OSError: the file cannot be opened or read.
    """
    digest = hashlib.sha256()
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def chmod_like_umask(path: str | Path) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would (0o666 minus the umask).

    safetensors writes its files 0o600; a validator or server running as another user of the
    same group must still be able to read a checkpoint.
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def fsync_file(path: str | Path) -> None:
    """Flush a written file's data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (a rename or a new file inside it). No-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never part.

    Writes ``<path>.tmp-<pid>``, fsyncs it, ``os.replace``s it onto ``path`` and fsyncs the
    directory.

    Raises:
        OSError: the write, fsync or rename failed (the temporary file is removed).
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | Path, obj: Any, **dumps: Any) -> None:
    """`atomic_write_bytes` of ``obj`` as indented UTF-8 JSON with a trailing newline; ``dumps``:
    more options of :func:`json.dumps` (``sort_keys``, ``ensure_ascii``, ``allow_nan``)."""
    text = json.dumps(obj, indent=2, **dumps) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))
