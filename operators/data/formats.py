"""Read the documents of one source file, cleaned, in order: text, JSONL or Parquet.

- ``text``: the whole file is one document, read and cleaned line by line.
- ``jsonl``: one JSON object per line; the document is the string under ``text_field``. Blank
  lines are skipped. A document is named ``<file>:<line>``.
- ``parquet``: the document is the string column ``text_field``; rows are read a batch at a time
  per row group. A document is named ``<file>:<row group>:<row in the group>``.
- ``auto``: each file by its suffix (see ``SourceFile.format``), so one corpus may mix them.

Each may be gzip- or zstd-compressed (see :mod:`trainforge.data.sources`); a compressed Parquet
file is first decompressed into a temporary file, since Parquet needs random access.

Malformed records (not UTF-8, not JSON, not an object, text field missing or not a string, null
in the text column, an unreadable row group or compressed stream, a file that is not Parquet) go
to :class:`MalformedLog`, which raises (``on_malformed: fail``) or counts them and keeps the
first :data:`MAX_EXAMPLES` as ``uri: location: reason`` (``skip``).

Memory: one document at a time (a text line longer than ``line_limit`` bytes, or a JSONL line,
is read past and its document counted too long), plus one Parquet batch.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge.data.clean import _BOM, CleanCounts, _Cleaner, decode_lines
from trainforge.data.errors import MalformedRecordError, SourceDecodeError
from trainforge.data.settings import PrepareSettings
from trainforge.data.sources import (
    SourceFile, check_unchanged, decompressed, open_random_access, open_raw,
)

logger = logging.getLogger(__name__)

#: Malformed records listed in the manifest (the count covers all).
MAX_EXAMPLES = 20
#: Rows per Parquet batch.
PARQUET_BATCH_ROWS = 128


@dataclass
class Cleaned:
    """One document after cleaning: ``text`` None when it grew past ``max_document_chars``."""

    name: str
    text: str | None
    counts: CleanCounts


class MalformedLog:
    """Where malformed records go: raised (``fail``) or counted (``skip``)."""

    def __init__(self, action: str) -> None:
        self.action = action
        self.count = 0
        self.examples: list[str] = []

    def report(self, err: MalformedRecordError) -> None:
        if self.action == "fail":
            raise err
        self.count += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(err.short)
            logger.warning("skipping a malformed record: %s", err.short)

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "count": self.count, "examples": list(self.examples)}


def line_limit(settings: PrepareSettings) -> int:
    """Longest line read (bytes): 4 bytes per character of the longest document, plus 1 MiB
    for JSON syntax and other fields."""
    return 4 * settings.max_document_chars + (1 << 20)


def read_source(source: SourceFile, settings: PrepareSettings, client_factory: Any,
                malformed: MalformedLog, tmp_dir: Path, info: dict[str, str]) -> Iterator[Cleaned]:
    """The cleaned documents of ``source`` (see the module doc). When done, ``info["sha256"]``
    is the SHA-256 of the stored bytes read ("" for uncompressed Parquet: not read whole).
    ``client_factory() -> boto3 S3 client`` is called for S3 sources only.

    Raises:
        MalformedRecordError: a malformed record and ``on_malformed: fail``.
        SourceChangedError, SourceAccessError: the file changed or cannot be read.
    """
    kind = source.format(settings.format)
    client = client_factory() if source.is_s3 else None
    if kind == "parquet":
        yield from _read_parquet(source, settings, client, malformed, tmp_dir, info)
        return
    compression = source.compression(settings.compression)
    raw = open_raw(source, client)
    try:
        stream = decompressed(raw, compression)
        reader = _read_text if kind == "text" else _read_jsonl
        try:
            yield from reader(source, stream, settings, malformed)
        except _decompress_errors() as err:
            if compression == "none":
                raise  # a plain read failed: not a record problem
            malformed.report(MalformedRecordError(
                source.uri, f"compressed byte {raw.count}", f"cannot decompress ({err})"))
        raw.drain()
    finally:
        raw.release()
    info["sha256"] = check_unchanged(source, raw)


def _decompress_errors() -> tuple[type[BaseException], ...]:
    """What a corrupt gzip or zstd stream raises."""
    import zstandard

    return (OSError, EOFError, zlib.error, zstandard.ZstdError)


def _cleaner(settings: PrepareSettings) -> _Cleaner:
    return _Cleaner(gutenberg=settings.strip_gutenberg_boilerplate,
                    whitespace=settings.normalize_whitespace,
                    unicode_form=settings.unicode_normalization,
                    max_chars=settings.max_document_chars)


def _read_text(source: SourceFile, stream: Any, settings: PrepareSettings,
               malformed: MalformedLog) -> Iterator[Cleaned]:
    cleaner = _cleaner(settings)
    try:
        for line in decode_lines(stream, source.uri, line_limit(settings)):
            cleaner.feed(line)
    except SourceDecodeError as err:
        malformed.report(err)
        return
    yield Cleaned(source.name, cleaner.finish(), cleaner.counts)


def _read_jsonl(source: SourceFile, stream: Any, settings: PrepareSettings,
                malformed: MalformedLog) -> Iterator[Cleaned]:
    limit = line_limit(settings)
    field = settings.text_field
    number = 0
    while raw := stream.readline(limit):
        number += 1
        if not raw.endswith(b"\n") and len(raw) == limit:  # too long to parse: drain the line
            while (more := stream.readline(limit)) and not more.endswith(b"\n"):
                pass
            yield Cleaned(f"{source.name}:{number}", None, CleanCounts())
            continue
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        if not raw.strip():
            continue
        where = f"line {number}"
        try:
            record = json.loads(raw)
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
            malformed.report(MalformedRecordError(source.uri, where, f"not JSON ({err})"))
            continue
        if not isinstance(record, dict):
            malformed.report(MalformedRecordError(
                source.uri, where, f"a JSON {type(record).__name__}, expected an object"))
            continue
        text = record.get(field)
        if not isinstance(text, str):
            problem = (f"no field {field!r} (fields: {', '.join(sorted(record)[:10])})"
                       if field not in record else
                       f"field {field!r} is {type(text).__name__}, expected a string")
            malformed.report(MalformedRecordError(source.uri, where, problem))
            continue
        cleaner = _cleaner(settings)
        cleaner.feed_text(text)
        yield Cleaned(f"{source.name}:{number}", cleaner.finish(), cleaner.counts)


@contextmanager
def parquet_file(source: SourceFile, compression: str, client: Any, malformed: MalformedLog,
                 tmp_dir: Path) -> Iterator[tuple[Any, Any]]:
    """``(pyarrow ParquetFile or None, raw reader or None)`` of ``source``: a compressed file is
    decompressed into a temporary file under ``tmp_dir`` first (Parquet needs random access).
    None once a file that cannot be decompressed or is not Parquet is reported to ``malformed``;
    the handle is closed on exit. After a whole read, the caller checks the source unchanged
    with the raw reader (``check_unchanged``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw, handle, failed = None, None, None
    if compression != "none":
        raw = open_raw(source, client)
        handle = tempfile.TemporaryFile(dir=tmp_dir)
        try:
            shutil.copyfileobj(decompressed(raw, compression), handle, 1 << 20)
            raw.drain()
        except _decompress_errors() as err:
            failed = f"cannot decompress ({err})"
        except BaseException:
            handle.close()
            raise
        finally:
            raw.release()
        handle.seek(0)
    else:
        handle = open_random_access(source, client)
    try:
        parquet = None
        if failed is None:
            try:
                parquet = pq.ParquetFile(handle)
            except (pa.ArrowException, OSError) as err:
                failed = f"not Parquet ({err})"
        if failed is not None:
            malformed.report(MalformedRecordError(source.uri, "file", failed))
        yield parquet, raw
    finally:
        handle.close()


def _read_parquet(source: SourceFile, settings: PrepareSettings, client: Any,
                  malformed: MalformedLog, tmp_dir: Path, info: dict[str, str]
                  ) -> Iterator[Cleaned]:
    import pyarrow as pa

    field = settings.text_field
    with parquet_file(source, source.compression(settings.compression), client, malformed,
                      tmp_dir) as (parquet, raw):
        if parquet is None:
            return
        schema = parquet.schema_arrow
        if field not in schema.names:
            columns = ", ".join(schema.names[:10])
            malformed.report(MalformedRecordError(
                source.uri, "file", f"no column {field!r} (columns: {columns})"))
            return
        kind = schema.field(field).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            malformed.report(MalformedRecordError(
                source.uri, "file", f"column {field!r} is {kind}, expected a string column"))
            return
        for group in range(parquet.num_row_groups):
            yield from _row_group(source, parquet, group, settings, malformed, pa)
    info["sha256"] = check_unchanged(source, raw)


def _row_group(source: SourceFile, parquet: Any, group: int, settings: PrepareSettings,
               malformed: MalformedLog, pa: Any) -> Iterator[Cleaned]:
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group],
                                          columns=[settings.text_field], use_threads=False):
            for text in batch.column(0).to_pylist():
                if text is None:
                    malformed.report(MalformedRecordError(
                        source.uri, f"row group {group}, row {row}",
                        f"null in text column {settings.text_field!r}"))
                else:
                    cleaner = _cleaner(settings)
                    cleaner.feed_text(text)
                    yield Cleaned(f"{source.name}:{group}:{row}", cleaner.finish(),
                                  cleaner.counts)
                row += 1
    except (pa.ArrowException, OSError) as err:
        malformed.report(MalformedRecordError(
            source.uri, f"row group {group}, row {row}", f"unreadable ({err})"))
