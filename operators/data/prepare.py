"""Prepare a tokenized dataset from local text files (docs/contracts.md, "Dataset").

    sources ─► clean (per file) ─► drop short, dedup ─► split by content hash
            ─► train byte-level BPE on train ─► encode to shards ─► manifest.json (last)

Everything is written into ``output_root/.<digest>.tmp-<pid>/`` and renamed to
``output_root/<digest>/`` at the end, so a dataset folder either is complete or does not exist.
When ``output_root/<digest>/`` already verifies, it is reused as is.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from operators.data.bpe import train_tokenizer
from operators.data.clean import CleanCounts, clean_file
from operators.data.errors import EmptyCorpusError, SourceChangedError, SourceNotFoundError
from operators.data.manifest import (
    FORMAT, MANIFEST_NAME, RECIPE_VERSION, SPLITS, TOKENIZER_NAME, dataset_digest, load_manifest,
    sha256_file, verify_dataset, write_json_atomic,
)
from operators.data.settings import PrepareSettings
from operators.data.shards import write_split
from operators.data.split import Document, deduplicate, split_documents

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceFile:
    """One matched source file: ``name`` is relative to the patterns' common base (POSIX)."""

    path: Path
    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class PreparedDataset:
    """A dataset folder that verifies, and what it holds.

    Attributes:
        path: absolute ``output_root/<digest>``.
        digest: dataset digest (the folder name).
        manifest: the parsed ``manifest.json``.
        reused: True when the folder existed and verified; nothing was rewritten.
        elapsed_s: wall time of :func:`prepare_dataset`, seconds.
    """

    path: Path
    digest: str
    manifest: dict[str, Any]
    reused: bool
    elapsed_s: float

    @property
    def documents(self) -> dict[str, int]:
        return {s: self.manifest["splits"][s]["documents"] for s in SPLITS}

    @property
    def tokens(self) -> dict[str, int]:
        return {s: self.manifest["splits"][s]["tokens"] for s in SPLITS}

    def summary(self) -> dict[str, Any]:
        """Small JSON-able summary (XCom, MLflow params, the task log)."""
        splits = self.manifest["splits"]
        return {
            "dataset_dir": str(self.path),
            "digest": self.digest,
            "reused": self.reused,
            "vocab_size": self.manifest["vocab_size"],
            "dtype": self.manifest["dtype"],
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes_utf8": {s: splits[s]["bytes_utf8"] for s in SPLITS},
            "shards": {s: len(splits[s]["shards"]) for s in SPLITS},
            "documents_in": self.manifest["stats"]["documents_in"],
            "removed": self.manifest["stats"]["removed"],
            "cleaning": self.manifest["stats"]["cleaning"],
        }


def resolve_sources(patterns: tuple[str, ...]) -> list[SourceFile]:
    """Expand glob patterns to regular files, hash them, and name them relative to the
    patterns' common base folder. Files matched twice count once; order is by name.

    Raises:
        SourceNotFoundError: a pattern matches no regular file.
    """
    paths: dict[str, Path] = {}
    bases: list[str] = []
    for pattern in patterns:
        absolute = os.path.abspath(os.path.expanduser(pattern))
        bases.append(_glob_base(absolute))
        matched = [p for p in sorted(glob.glob(absolute, recursive=True)) if os.path.isfile(p)]
        if not matched:
            raise SourceNotFoundError(pattern, absolute)
        for match in matched:
            paths.setdefault(os.path.realpath(match), Path(match))
    base = os.path.commonpath(bases)
    files = []
    for path in paths.values():
        size, sha = sha256_file(path)
        name = Path(os.path.relpath(path, base)).as_posix()
        files.append(SourceFile(path=path, name=name, bytes=size, sha256=sha))
    return sorted(files, key=lambda f: f.name)


def _glob_base(pattern: str) -> str:
    """The folder part of an absolute pattern before its first wildcard component."""
    parts = Path(pattern).parts
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return str(Path(*fixed))


def prepare_dataset(settings: PrepareSettings, output_root: Path | str,
                    log: logging.Logger | logging.LoggerAdapter = logger) -> PreparedDataset:
    """Prepare (or reuse) ``output_root/<digest>/`` for ``settings``.

    Deterministic: the same source bytes, settings and ``tokenizers`` version give the same
    digest and byte-identical shards, tokenizer and manifest (source URIs aside).

    Raises:
        SourceNotFoundError, SourceDecodeError, SourceChangedError, EmptyCorpusError: see
            ``operators.data.errors``; all are :class:`DataPrepError`.
        OSError: the output folder cannot be written.
    """
    started = time.monotonic()
    output_root = Path(output_root).absolute()
    sources = resolve_sources(settings.sources)
    digest = dataset_digest(sources=[{"name": s.name, "sha256": s.sha256} for s in sources],
                            settings=settings.output_settings(),
                            tokenizers_version=tokenizers.__version__)
    final = output_root / digest
    log.info("dataset %s: %d source files, %d bytes", digest[:12], len(sources),
             sum(s.bytes for s in sources))
    if (final / MANIFEST_NAME).exists():
        problems = verify_dataset(final)
        if not problems:
            log.info("dataset %s already prepared at %s; reusing it", digest[:12], final)
            return PreparedDataset(final, digest, load_manifest(final), True,
                                   time.monotonic() - started)
        log.warning("dataset %s at %s does not verify (%s); preparing it again",
                    digest[:12], final, "; ".join(problems[:3]))

    output_root.mkdir(parents=True, exist_ok=True)
    work = output_root / f".{digest}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        manifest = _build(settings, sources, digest, work, log)
        return _publish(work, final, digest, manifest, started, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build(settings: PrepareSettings, sources: list[SourceFile], digest: str, work: Path,
           log: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:
    counts = CleanCounts()
    documents: list[Document] = []
    removed = {"empty": 0, "too_short": 0, "duplicate": 0}
    for source in sources:
        cleaned = clean_file(source.path,
                             strip_gutenberg_boilerplate=settings.strip_gutenberg_boilerplate,
                             normalize_whitespace=settings.normalize_whitespace,
                             unicode_normalization=settings.unicode_normalization)
        if cleaned.file_sha256 != source.sha256:
            raise SourceChangedError(str(source.path), source.sha256, cleaned.file_sha256)
        counts.add(cleaned.counts)
        if not cleaned.text:
            removed["empty"] += 1
        elif len(cleaned.text) < settings.min_document_chars:
            removed["too_short"] += 1
        else:
            documents.append(Document(source.name, cleaned.text, cleaned.text_sha256))
    documents, removed["duplicate"] = deduplicate(documents)
    log.info("cleaned %d documents: kept %d, removed %s, rules removed %s",
             len(sources), len(documents), removed, counts.as_dict())
    if len(documents) < 2:
        raise EmptyCorpusError(len(sources), len(documents), removed)
    train, validation = split_documents(documents, settings.validation_fraction)
    log.info("split by document hash: %d train, %d validation", len(train), len(validation))

    tokenizer = train_tokenizer([d.text for d in train], vocab_size=settings.vocab_size,
                                special_tokens=settings.special_tokens)
    (work / TOKENIZER_NAME).write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    tok_bytes, tok_sha = sha256_file(work / TOKENIZER_NAME)
    log.info("trained byte-level BPE on the train split: %d tokens (asked %d)",
             tokenizer.get_vocab_size(), settings.vocab_size)

    splits = {}
    for split, docs in zip(SPLITS, (train, validation)):
        splits[split] = write_split(tokenizer, [d.text for d in docs], folder=work, split=split,
                                    dtype=settings.dtype, shard_tokens=settings.shard_tokens,
                                    eos_id=0)
        splits[split]["document_names"] = [d.name for d in docs]
        log.info("%s: %d documents, %d tokens in %d shard(s)", split, len(docs),
                 splits[split]["tokens"], len(splits[split]["shards"]))
    return {
        "format": FORMAT,
        "digest": digest,
        "dtype": settings.dtype,
        "vocab_size": settings.vocab_size,
        "eos_token": settings.eos_token,
        "eos_id": 0,
        "tokenizer": {"file": TOKENIZER_NAME, "bytes": tok_bytes, "sha256": tok_sha,
                      "trained_vocab_size": tokenizer.get_vocab_size()},
        "splits": splits,
        "sources": [{"uri": s.path.absolute().as_uri(), "name": s.name, "bytes": s.bytes,
                     "sha256": s.sha256} for s in sources],
        "source_patterns": list(settings.sources),
        "settings": settings.output_settings(),
        "recipe": RECIPE_VERSION,
        "tokenizers_version": tokenizers.__version__,
        "stats": {"documents_in": len(sources), "removed": removed,
                  "cleaning": counts.as_dict()},
    }


def _publish(work: Path, final: Path, digest: str, manifest: dict[str, Any], started: float,
             log: logging.Logger | logging.LoggerAdapter) -> PreparedDataset:
    """Write the manifest last, then move the folder into place (see module doc)."""
    write_json_atomic(work / MANIFEST_NAME, manifest)
    _fsync_dir(work)
    if final.exists():  # a broken earlier attempt, or another process that just finished
        if not verify_dataset(final):
            log.info("dataset %s was completed by another process; reusing it", digest[:12])
            return PreparedDataset(final, digest, load_manifest(final), True,
                                   time.monotonic() - started)
        broken = final.with_name(f".{digest}.broken-{os.getpid()}")
        os.replace(final, broken)
        shutil.rmtree(broken, ignore_errors=True)
    try:
        os.replace(work, final)
    except OSError:
        if final.exists() and not verify_dataset(final):  # lost a race to an identical result
            return PreparedDataset(final, digest, load_manifest(final), True,
                                   time.monotonic() - started)
        raise
    _fsync_dir(final.parent)
    elapsed = time.monotonic() - started
    log.info("dataset %s ready at %s in %.1f s", digest[:12], final, elapsed)
    return PreparedDataset(final, digest, manifest, False, elapsed)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
