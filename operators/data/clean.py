"""Read one source file as one document and clean it, line by line.

Rules, in the order they apply to each line: strict UTF-8 decoding (``\\r\\n`` and a lone
trailing ``\\r`` end a line like ``\\n``), a Unicode normal form (``NFC`` by default), Project
Gutenberg boilerplate (``strip_gutenberg_boilerplate``: header, footer and ``<<...>>`` notices
of at most ``MAX_NOTICE_LINES`` lines) and whitespace (``normalize_whitespace``). Each rule
counts what it removed (:class:`CleanCounts`). The rules in full: docs/data.md, "Cleaning rules".
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from trainforge.data.errors import SourceDecodeError

_BOM = b"\xef\xbb\xbf"
_START = re.compile(
    r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG|^\*END\*\s*THE SMALL PRINT", re.IGNORECASE
)
_END = re.compile(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|^END OF (THE )?PROJECT GUTENBERG",
                  re.IGNORECASE)
_NOTICE_WORDS = re.compile(r"ELECTRONIC\s+VERSION|PROJECT\s+GUTENBERG|WORLD\s+LIBRARY",
                           re.IGNORECASE)
_HSPACE = re.compile(r"[^\S\n]+")
#: A ``<<`` block longer than this is text, not a licence notice (the World Library one is 8).
MAX_NOTICE_LINES = 40


@dataclass
class CleanCounts:
    """What the cleaning rules removed, summed over documents."""

    gutenberg_header_lines: int = 0
    gutenberg_footer_lines: int = 0
    gutenberg_notice_lines: int = 0
    unicode_changed_lines: int = 0
    whitespace_chars: int = 0
    blank_lines: int = 0

    def add(self, other: CleanCounts) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class CleanedFile:
    """One source file after cleaning.

    Attributes:
        text: the cleaned document (lines joined by ``\\n``, no trailing newline).
        text_sha256: SHA-256 hex of ``text`` in UTF-8: the document's identity for dedup and split.
        file_sha256: SHA-256 hex of the raw file bytes as read.
        file_bytes: size of the raw file in bytes.
        counts: what each rule removed from this file.
    """

    text: str
    text_sha256: str
    file_sha256: str
    file_bytes: int
    counts: CleanCounts


class _Cleaner:
    """Line-by-line state machine; :meth:`feed` one decoded line at a time, then :meth:`finish`."""

    def __init__(self, *, gutenberg: bool, whitespace: bool, unicode_form: str,
                 max_chars: int | None = None) -> None:
        self.gutenberg = gutenberg
        self.whitespace = whitespace
        self.unicode_form = unicode_form
        self.max_chars = max_chars
        self.counts = CleanCounts()
        self.out: list[str] = []
        self.chars = -1  # len("\n".join(self.out))
        self.overflow = False  # the output grew past max_chars: it is no longer kept
        self.pending_blank = 0  # blank lines seen since the last kept non-blank line
        self.raw_kept = 0  # raw lines that reached the output since the last header reset
        self.notice: list[str] | None = None  # buffered ``<<`` block, or None
        self.ended = False  # footer seen: drop everything else

    def feed(self, line: str | None) -> None:
        """One line without its line ending; None stands for a line too long to read."""
        if line is None:
            self._set_overflow()
            return
        if self.ended:
            self.counts.gutenberg_footer_lines += 1
            return
        if self.unicode_form != "none":
            normal = unicodedata.normalize(self.unicode_form, line)
            self.counts.unicode_changed_lines += normal != line
            line = normal
        if self.gutenberg and self._gutenberg_rule(line):
            return
        self._keep(line)

    def _gutenberg_rule(self, line: str) -> bool:
        """Apply the Gutenberg rules; True when the line was consumed."""
        stripped = line.strip()
        if self.notice is not None:
            self.notice.append(line)
            if stripped.endswith(">>"):
                self._close_notice()
            elif len(self.notice) >= MAX_NOTICE_LINES:
                self._flush_notice_as_text()
            return True
        if stripped.startswith("<<"):
            self.notice = [line]
            if stripped.endswith(">>") and len(stripped) >= 4:
                self._close_notice()
            return True
        if _START.match(stripped):
            self.counts.gutenberg_header_lines += self.raw_kept + 1
            self.out.clear()
            self.chars = -1
            self.overflow = False
            self.pending_blank = 0
            self.raw_kept = 0
            return True
        if _END.match(stripped):
            self.counts.gutenberg_footer_lines += 1
            self.ended = True
            return True
        return False

    def _close_notice(self) -> None:
        block, self.notice = self.notice or [], None
        if _NOTICE_WORDS.search(" ".join(block)):
            self.counts.gutenberg_notice_lines += len(block)
        else:
            for kept in block:
                self._keep(kept)

    def _flush_notice_as_text(self) -> None:
        block, self.notice = self.notice or [], None
        for kept in block:
            self._keep(kept)

    def _append(self, line: str) -> None:
        if self.overflow:
            return
        self.chars += len(line) + 1
        if self.max_chars is not None and self.chars > self.max_chars:
            self._set_overflow()
            return
        self.out.append(line)

    def _set_overflow(self) -> None:
        self.overflow = True
        self.out.clear()

    def _keep(self, line: str) -> None:
        self.raw_kept += 1
        if not self.whitespace:
            self._append(line)
            return
        collapsed = _HSPACE.sub(" ", line).rstrip()
        self.counts.whitespace_chars += len(line) - len(collapsed)
        if not collapsed:
            self.pending_blank += 1
            return
        if self.pending_blank:
            if self.chars >= 0:  # one blank line between paragraphs; none at the start
                self._append("")
                self.counts.blank_lines += self.pending_blank - 1
            else:
                self.counts.blank_lines += self.pending_blank
            self.pending_blank = 0
        self._append(collapsed)

    def finish(self) -> str | None:
        """The cleaned text, or None when it grew past ``max_chars``."""
        if self.notice is not None:  # unterminated ``<<``: it was text after all
            self._flush_notice_as_text()
        self.counts.blank_lines += self.pending_blank  # trailing blank lines
        self.pending_blank = 0
        return None if self.overflow else "\n".join(self.out)

    def feed_text(self, text: str) -> None:
        """Feed an in-memory document (a JSONL or Parquet record) line by line."""
        for line in text.split("\n"):
            self.feed(line[:-1] if line.endswith("\r") else line)


def decode_lines(stream: BinaryIO, uri: str, line_limit: int) -> Iterator[str | None]:
    """UTF-8 lines of a binary stream without their line endings (rule 1 of the module doc).

    A line longer than ``line_limit`` bytes is read past and yields None (its document is too
    long), so memory stays bounded by ``line_limit``.

    Raises:
        SourceDecodeError: a line is not UTF-8; names the file, the line and the byte offset.
    """
    offset = 0
    number = 0
    while True:
        raw = stream.readline(line_limit)
        if not raw:
            return
        number += 1
        start = offset
        offset += len(raw)
        if not raw.endswith(b"\n") and len(raw) == line_limit:
            while (more := stream.readline(line_limit)) and not more.endswith(b"\n"):
                offset += len(more)
            offset += len(more)
            yield None
            continue
        body = raw[:-1] if raw.endswith(b"\n") else raw
        if body.endswith(b"\r"):
            body = body[:-1]
        if start == 0 and body.startswith(_BOM):
            body = body[len(_BOM):]
            start += len(_BOM)
        try:
            yield body.decode("utf-8")
        except UnicodeDecodeError as err:
            raise SourceDecodeError(uri, start + err.start, err.reason, line=number) from err


def clean_file(path: Path, *, strip_gutenberg_boilerplate: bool, normalize_whitespace: bool,
               unicode_normalization: str) -> CleanedFile:
    """Read ``path`` line by line as one UTF-8 document and clean it (rules in the module doc).

    Raises:
        SourceDecodeError: the file is not UTF-8; names the file and the byte offset.
        OSError: the file cannot be read.
    """
    cleaner = _Cleaner(gutenberg=strip_gutenberg_boilerplate, whitespace=normalize_whitespace,
                       unicode_form=unicode_normalization)
    with open(path, "rb") as f:
        hashing = _HashingFile(f)
        for line in decode_lines(hashing, str(path), 1 << 62):
            cleaner.feed(line)
    text = cleaner.finish() or ""
    return CleanedFile(
        text=text,
        text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        file_sha256=hashing.sha.hexdigest(),
        file_bytes=hashing.count,
        counts=cleaner.counts,
    )


class _HashingFile:
    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.count = f, hashlib.sha256(), 0

    def readline(self, limit: int) -> bytes:
        raw = self.f.readline(limit)
        self.sha.update(raw)
        self.count += len(raw)
        return raw
