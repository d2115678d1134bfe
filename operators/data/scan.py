"""The scan pass: read every source once, clean, filter, deduplicate and split into spools.

For each document, in corpus order (sources by name, records in file order):

1. cleaned (``trainforge.data.clean``); a malformed record goes to the :class:`MalformedLog`;
2. dropped when empty, shorter than ``min_document_chars`` or longer than
   ``max_document_chars`` (``removed.empty`` / ``too_short`` / ``too_long``);
3. dropped when its text's SHA-256 was seen before (``removed.duplicate``, exact dedup across
   files and formats; memory: one 32-byte hash per kept document);
4. appended to the validation or train spool by the content-hash rule of
   :mod:`trainforge.data.split`, whose fallback is applied at the end without rereading.

Memory stays bounded by one document plus the hash set; the text goes to disk.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.data.clean import CleanCounts
from trainforge.data.errors import EmptyCorpusError
from trainforge.data.formats import MalformedLog, read_source
from trainforge.data.settings import PrepareSettings
from trainforge.data.sources import SourceFile
from trainforge.data.split import in_validation
from trainforge.data.spool import Range, SpoolWriter, record_at, without_record

logger = logging.getLogger(__name__)


@dataclass
class ScanResult:
    """What the scan pass kept (as spool ranges) and what it removed."""

    ranges: dict[str, list[Range]]
    documents: dict[str, int]
    documents_in: int
    removed: dict[str, int]
    malformed: MalformedLog
    counts: CleanCounts
    source_sha256: dict[str, str] = field(default_factory=dict)  # location -> bytes read
    bytes_utf8: int = 0
    seconds: float = 0.0


@dataclass
class _Extreme:
    """The train document with the smallest hash, or the validation one with the largest."""

    sha256: bytes
    offset: int


def scan_sources(sources: list[SourceFile], settings: PrepareSettings, client_factory: Any,
                 spool_dir: Path, chunk_bytes: int,
                 log: logging.Logger | logging.LoggerAdapter = logger) -> ScanResult:
    """Run the scan pass over ``sources`` into ``spool_dir`` (see the module doc);
    ``client_factory() -> boto3 S3 client`` is called only if a source is on S3.

    Raises:
        EmptyCorpusError: fewer than 2 documents are left.
        MalformedRecordError, SourceChangedError, SourceAccessError: from reading.
    """
    started = time.monotonic()
    spool_dir.mkdir(parents=True, exist_ok=True)
    writers = {split: SpoolWriter(spool_dir / f"{split}.spool", chunk_bytes)
               for split in ("train", "validation")}
    removed = {"empty": 0, "too_short": 0, "too_long": 0, "duplicate": 0}
    result = ScanResult({}, {}, 0, removed, MalformedLog(settings.on_malformed), CleanCounts())
    seen: set[bytes] = set()
    lowest_train: _Extreme | None = None
    highest_validation: _Extreme | None = None
    try:
        for source in sources:
            info: dict[str, str] = {}
            docs = read_source(source, settings, client_factory, result.malformed, spool_dir, info)
            for doc in docs:
                result.documents_in += 1
                result.counts.add(doc.counts)
                text = doc.text
                if text is None or len(text) > settings.max_document_chars:
                    removed["too_long"] += 1
                    continue
                if not text:
                    removed["empty"] += 1
                    continue
                if len(text) < settings.min_document_chars:
                    removed["too_short"] += 1
                    continue
                data = text.encode("utf-8")
                sha = hashlib.sha256(data).digest()
                if settings.deduplicate:
                    if sha in seen:
                        removed["duplicate"] += 1
                        continue
                    seen.add(sha)
                result.bytes_utf8 += len(data)
                if in_validation(sha, settings.validation_fraction):
                    offset = writers["validation"].append(sha, doc.name, data)
                    if highest_validation is None or sha > highest_validation.sha256:
                        highest_validation = _Extreme(sha, offset)
                else:
                    offset = writers["train"].append(sha, doc.name, data)
                    if lowest_train is None or sha < lowest_train.sha256:
                        lowest_train = _Extreme(sha, offset)
            result.source_sha256[source.location] = info.get("sha256", "")
        _fallback(writers, lowest_train, highest_validation, result)
    finally:
        for writer in writers.values():
            writer.close()
    kept = sum(result.documents.values())
    log.info("scanned %d source files: %d documents read, %d kept, removed %s, malformed %d, "
             "cleaning rules removed %s", len(sources), result.documents_in, kept, removed,
             result.malformed.count, result.counts.as_dict())
    if kept < 2 or min(result.documents.values()) < 1:
        raise EmptyCorpusError(result.documents_in, kept, removed)
    result.seconds = time.monotonic() - started
    return result


def _fallback(writers: dict[str, SpoolWriter], lowest_train: _Extreme | None,
              highest_validation: _Extreme | None, result: ScanResult) -> None:
    """Close the spools; move one document when a split is empty (see trainforge.data.split)."""
    train, validation = writers["train"], writers["validation"]
    if validation.documents == 0 and train.documents >= 2 and lowest_train is not None:
        train_ranges = train.close()
        record, size = record_at(str(train.path), lowest_train.offset)
        validation.append(record.sha256, record.name, record.text)
        result.ranges = {"train": without_record(train_ranges, lowest_train.offset, size),
                         "validation": validation.close()}
        result.documents = {"train": train.documents - 1, "validation": 1}
    elif train.documents == 0 and validation.documents >= 2 and highest_validation is not None:
        validation_ranges = validation.close()
        record, size = record_at(str(validation.path), highest_validation.offset)
        train.append(record.sha256, record.name, record.text)
        result.ranges = {"train": train.close(),
                         "validation": without_record(validation_ranges,
                                                      highest_validation.offset, size)}
        result.documents = {"train": 1, "validation": validation.documents - 1}
    else:
        result.ranges = {"train": train.close(), "validation": validation.close()}
        result.documents = {"train": train.documents, "validation": validation.documents}
