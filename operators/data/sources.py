"""Source files: expand local and ``s3://`` glob patterns, identify each file, open it.

Identity (what the dataset digest sees): the file's name relative to the patterns' common base
plus its content: SHA-256 for local files (hashed here, streamed), size and ETag for S3 objects
(from the listing; hashing would mean downloading the corpus twice). Reading checks that the
content is still the one identified (local: the SHA-256 of what was read, or size and mtime for
random-access formats; S3: ``IfMatch`` on every GET).

Compression (``auto``): ``.gz`` is gzip, ``.zst`` / ``.zstd`` is zstd, anything else is read
as is. Decompression streams: only a read buffer is held, never a whole file.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from trainforge.data import s3
from trainforge.data.errors import SourceChangedError, SourceNotFoundError
from trainforge.storage.files import sha256_file

#: Read buffer of the streamed readers (bytes).
READ_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class SourceFile:
    """One matched source file.

    Attributes:
        location: the absolute local path, or ``s3://bucket/key``.
        name: path relative to the patterns' common base (POSIX); orders the corpus.
        bytes: size as stored (compressed size for compressed files).
        sha256: SHA-256 of the stored bytes (local files; "" for S3 until read).
        etag: S3 ETag ("" for local files).
        mtime_ns: local modification time when identified (0 for S3).
    """

    location: str
    name: str
    bytes: int
    sha256: str = ""
    etag: str = ""
    mtime_ns: int = 0

    @property
    def path(self) -> Path:
        return Path(self.location)

    @property
    def is_s3(self) -> bool:
        return self.location.startswith("s3://")

    @property
    def uri(self) -> str:
        """``file:///abs/path`` or ``s3://bucket/key``."""
        return self.location if self.is_s3 else self.path.as_uri()

    def identity(self) -> dict[str, Any]:
        """The digest's view of the file."""
        if self.is_s3:
            return {"name": self.name, "bytes": self.bytes, "etag": self.etag}
        return {"name": self.name, "sha256": self.sha256}

    def format(self, setting: str) -> str:
        """``text``, ``jsonl`` or ``parquet`` for this file under the ``format`` setting."""
        if setting != "auto":
            return setting
        lower = self.name.lower()
        for suffix in (".gz", ".zst", ".zstd"):
            lower = lower.removesuffix(suffix)
        if lower.endswith((".jsonl", ".ndjson")):
            return "jsonl"
        if lower.endswith((".parquet", ".pq")):
            return "parquet"
        return "text"

    def compression(self, setting: str) -> str:
        """``gzip``, ``zstd`` or ``none`` for this file under the ``compression`` setting."""
        if setting != "auto":
            return setting
        lower = self.name.lower()
        if lower.endswith(".gz"):
            return "gzip"
        if lower.endswith((".zst", ".zstd")):
            return "zstd"
        return "none"


def resolve_sources(patterns: tuple[str, ...], client_factory: Any = None) -> list[SourceFile]:
    """Expand local and S3 glob patterns into files, identified and named (see module doc).
    A file matched by several patterns counts once; the result is in name order.

    Args:
        client_factory: ``() -> boto3 S3 client``, called once if a pattern is ``s3://``.

    Raises:
        SourceNotFoundError: a pattern matches nothing.
        SourceAccessError: an S3 pattern cannot be listed.
    """
    local: dict[str, tuple[Path, str]] = {}
    remote: dict[str, s3.S3Object] = {}
    local_bases: list[str] = []
    remote_bases: list[str] = []
    client = None
    for pattern in patterns:
        if s3.is_s3(pattern):
            client = client or client_factory()
            bucket, key_pattern = s3.split_uri(pattern)
            folder = s3.fixed_prefix(key_pattern).rpartition("/")[0]  # like _glob_base
            remote_bases.append(f"{bucket}/{folder}".rstrip("/"))
            objects = s3.list_matching(client, pattern)
            if not objects:
                raise SourceNotFoundError(pattern, pattern)
            for obj in objects:
                remote.setdefault(obj.uri, obj)
            continue
        absolute = os.path.abspath(os.path.expanduser(pattern))
        local_bases.append(_glob_base(absolute))
        matched = [p for p in sorted(glob.glob(absolute, recursive=True)) if os.path.isfile(p)]
        if not matched:
            raise SourceNotFoundError(pattern, absolute)
        for match in matched:
            local.setdefault(os.path.realpath(match), (Path(match), pattern))
    files: list[SourceFile] = []
    if local:
        base = os.path.commonpath(local_bases)
        for path, _ in local.values():
            stat = path.stat()
            size, sha = path.stat().st_size, sha256_file(path)
            files.append(SourceFile(str(path.absolute()),
                                    Path(os.path.relpath(path, base)).as_posix(), size, sha,
                                    mtime_ns=stat.st_mtime_ns))
    if remote:
        base = _common_prefix(remote_bases)
        for obj in remote.values():
            full = f"{obj.bucket}/{obj.key}"
            name = str(PurePosixPath(full).relative_to(base)) if base else full
            files.append(SourceFile(obj.uri, name, obj.size, etag=obj.etag))
    return sorted(files, key=lambda f: (f.name, f.location))


def _glob_base(pattern: str) -> str:
    """The folder part of an absolute pattern before its first wildcard component."""
    fixed = []
    for part in Path(pattern).parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return str(Path(*fixed))


def _common_prefix(bases: list[str]) -> str:
    parts = [b.split("/") for b in bases]
    common = []
    for segments in zip(*parts):
        if len(set(segments)) != 1:
            break
        common.append(segments[0])
    return "/".join(common)


class HashingReader(io.RawIOBase):
    """Pass-through raw reader that hashes and counts the bytes read (SHA-256).

    The decompressing and buffering layers stacked on it close it when they are dropped; that
    close is ignored, so the rest can still be drained: :meth:`release` closes the source.
    """

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.sha = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.raw.readinto(buffer)
        if n:
            self.sha.update(memoryview(buffer)[:n])
            self.count += n
        return n or 0

    def drain(self) -> None:
        """Read to the end, so that the hash covers the whole file."""
        buf = bytearray(READ_BUFFER_BYTES)
        while self.readinto(buf):
            pass

    def close(self) -> None:
        """Ignored (see the class doc)."""

    def release(self) -> None:
        """Close the underlying file or S3 stream."""
        self.raw.close()


def open_raw(source: SourceFile, client: Any) -> HashingReader:
    """The stored bytes of ``source`` as a hashing raw stream."""
    raw = s3.S3StreamReader(client, _object(source)) if source.is_s3 \
        else io.FileIO(source.path, "rb")
    return HashingReader(raw)


def decompressed(raw: io.RawIOBase, compression: str) -> BinaryIO:
    """A buffered binary stream of the decompressed bytes of ``raw`` (which it does not own)."""
    if compression == "gzip":
        return gzip.GzipFile(fileobj=io.BufferedReader(raw, READ_BUFFER_BYTES), mode="rb")
    if compression == "zstd":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_size=READ_BUFFER_BYTES,
                                                            read_across_frames=True,
                                                            closefd=False)
        return io.BufferedReader(reader, READ_BUFFER_BYTES)  # type: ignore[arg-type]
    return io.BufferedReader(raw, READ_BUFFER_BYTES)  # type: ignore[arg-type]


def open_random_access(source: SourceFile, client: Any) -> BinaryIO:
    """A seekable binary file of an uncompressed source (Parquet)."""
    if source.is_s3:
        return io.BufferedReader(s3.S3RangeReader(client, _object(source)), 1 << 16)
    return open(source.path, "rb")


def check_unchanged(source: SourceFile, read: HashingReader | None) -> str:
    """After reading: the SHA-256 of what was read (streamed) or "" (random access).

    Raises:
        SourceChangedError: a local file's content (or size and mtime) changed since it was
            identified. S3 changes surface while reading (``IfMatch``).
    """
    if read is not None:
        got = read.sha.hexdigest()
        if not source.is_s3 and got != source.sha256:
            raise SourceChangedError(str(source.path), source.sha256, got)
        return got
    if not source.is_s3:
        stat = source.path.stat()
        if (stat.st_size, stat.st_mtime_ns) != (source.bytes, source.mtime_ns):
            raise SourceChangedError(str(source.path), source.sha256, "(size or mtime changed)")
    return source.sha256


def _object(source: SourceFile) -> s3.S3Object:
    bucket, key = s3.split_uri(source.uri)
    return s3.S3Object(bucket, key, source.bytes, source.etag)
