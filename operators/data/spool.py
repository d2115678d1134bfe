"""Cleaned documents on disk between the scan and the encoding passes.

One spool file per split holds the kept documents in corpus order as records::

    sha256 (32 bytes) | name length (uint32 LE) | text length (uint32 LE) | name | text (UTF-8)

While writing, the spool is cut into :class:`Range` chunks of about ``chunk_bytes`` at record
boundaries. A range is the unit of work of an encoding worker and of the tokenizer trainer's
reader; ranges change how work is shared, never the output (the shards are the documents'
encodings in spool order, whatever the ranges).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HEADER = struct.Struct("<32sII")


@dataclass(frozen=True)
class Range:
    """``nbytes`` bytes of ``path`` from ``offset``: ``documents`` whole records."""

    path: str
    offset: int
    nbytes: int
    documents: int


@dataclass(frozen=True)
class Record:
    sha256: bytes
    name: str
    text: bytes  # UTF-8


class SpoolWriter:
    """Append records to one spool file, cutting ranges of about ``chunk_bytes``."""

    def __init__(self, path: Path, chunk_bytes: int) -> None:
        self.path = path
        self.chunk_bytes = chunk_bytes
        self._file = open(path, "wb")
        self.offset = 0
        self.documents = 0
        self.ranges: list[Range] = []
        self._start = 0
        self._count = 0

    def append(self, sha256: bytes, name: str, text: bytes) -> int:
        """Write one record; returns its offset."""
        name_bytes = name.encode("utf-8")
        offset = self.offset
        self._file.write(HEADER.pack(sha256, len(name_bytes), len(text)))
        self._file.write(name_bytes)
        self._file.write(text)
        self.offset += HEADER.size + len(name_bytes) + len(text)
        self.documents += 1
        self._count += 1
        if self.offset - self._start >= self.chunk_bytes:
            self._cut()
        return offset

    def _cut(self) -> None:
        if self._count:
            self.ranges.append(Range(str(self.path), self._start, self.offset - self._start,
                                     self._count))
        self._start, self._count = self.offset, 0

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> list[Range]:
        """Flush; returns the ranges covering every record."""
        if self._file.closed:
            return self.ranges
        self._cut()
        self._file.close()
        return self.ranges


def read_range(rng: Range) -> Iterator[Record]:
    """The records of one range, in order."""
    with open(rng.path, "rb") as f:
        f.seek(rng.offset)
        data = f.read(rng.nbytes)
    pos = 0
    while pos < len(data):
        sha, name_len, text_len = HEADER.unpack_from(data, pos)
        pos += HEADER.size
        name = data[pos:pos + name_len].decode("utf-8")
        pos += name_len
        yield Record(sha, name, data[pos:pos + text_len])
        pos += text_len


def record_at(path: str, offset: int) -> tuple[Record, int]:
    """The record at ``offset`` and its size in bytes."""
    with open(path, "rb") as f:
        f.seek(offset)
        sha, name_len, text_len = HEADER.unpack(f.read(HEADER.size))
        name = f.read(name_len).decode("utf-8")
        text = f.read(text_len)
    return Record(sha, name, text), HEADER.size + name_len + text_len


def without_record(ranges: list[Range], offset: int, size: int) -> list[Range]:
    """``ranges`` with the record at ``offset`` (``size`` bytes) cut out (the split's fallback
    moves one document to the other split)."""
    out: list[Range] = []
    for rng in ranges:
        if not rng.offset <= offset < rng.offset + rng.nbytes:
            out.append(rng)
            continue
        before = sum(1 for _ in read_range(Range(rng.path, rng.offset, offset - rng.offset, 0)))
        if before:
            out.append(Range(rng.path, rng.offset, offset - rng.offset, before))
        after = rng.documents - before - 1
        if after:
            out.append(Range(rng.path, offset + size, rng.offset + rng.nbytes - offset - size,
                             after))
    return out
