"""Prepare a tokenized dataset from local or S3 sources (docs/contracts.md, "Dataset";
docs/data.md for every option).

    sources ─► scan: read (streamed), clean, filter, dedup, split by content hash ─► spools
            ─► tokenizer: train byte-level BPE on the train spool, or reuse one (trainforge's
               own, or a pretrained model's: ``settings.eos_ids``)
            ─► encode the spools in parallel workers ─► shards ─► manifest.json (last)

Everything is written into ``output_root/.<digest>.tmp-<pid>/`` and renamed to
``output_root/<digest>/`` at the end, so a dataset folder either is complete or does not exist.
When ``output_root/<digest>/`` already verifies, it is reused as is. An ``s3://`` output root is
prepared in a local staging folder and uploaded through the storage interface, manifest last
(:mod:`trainforge.data.remote`, :mod:`trainforge.storage`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from trainforge.data import s3
from trainforge.data.bpe import load_tokenizer, train_tokenizer
from trainforge.data.chat_prepare import build_examples, tokenizer_files_digest
from trainforge.data.encode import encode_splits
from trainforge.data.errors import InvalidSettingsError, SourceAccessError, TokenizerSourceError
from trainforge.data.manifest import (
    FORMAT, MANIFEST_NAME, RECIPE_VERSION, SPLITS, TOKENIZER_NAME, dataset_digest, load_manifest,
    verify_dataset,
)
from trainforge.data.remote import prepare_remote
from trainforge.data.result import PreparedDataset
from trainforge.data.scan import ScanResult, scan_sources
from trainforge.data.model_tokenizer import REMEDY
from trainforge.data.settings import PrepareSettings, dtype_for
from trainforge.data.sources import SourceFile, resolve_sources
from trainforge.data.spool import read_range
from trainforge.storage import storage_for
from trainforge.storage.files import atomic_write_json, fsync_dir, sha256_file
from trainforge.storage.s3 import make_client

logger = logging.getLogger(__name__)
Log = logging.Logger | logging.LoggerAdapter

#: Spool range size bounds (bytes); see :func:`chunk_bytes`.
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 16 << 20
#: Spool ranges per encoding worker that a corpus is cut into (when it is large enough).
RANGES_PER_WORKER = 8


@dataclass(frozen=True)
class _Reused:
    """A reused tokenizer.json: its bytes, the parsed tokenizer, the dataset's vocab_size."""

    data: bytes
    tokenizer: tokenizers.Tokenizer
    vocab_size: int


class _Client:
    """The S3 client, made on first use (local-only runs never import boto3)."""

    def __init__(self, endpoint_url: str | None) -> None:
        self.endpoint_url = endpoint_url
        self._client: Any = None

    def __call__(self) -> Any:
        if self._client is None:
            self._client = make_client(self.endpoint_url)
        return self._client


def chunk_bytes(settings: PrepareSettings, source_bytes: int) -> int:
    """Spool range size: ``2 x workers`` ranges are in flight, each held as text, as the
    tokenizer's transient objects and as ids; a factor 8 keeps that inside the memory budget.
    It is also small enough that ``source_bytes`` (the sources' stored size, at most their text
    for compressed ones) makes :data:`RANGES_PER_WORKER` ranges per worker: with a few large
    ranges, one worker would encode a whole split while the others wait."""
    budget = settings.memory_budget_mib << 20
    share = source_bytes // (RANGES_PER_WORKER * settings.workers)
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, budget // (8 * settings.workers), share))


def prepare_dataset(settings: PrepareSettings, output_root: Path | str, *,
                    staging_root: Path | str | None = None, log: Log = logger,
                    s3_client: Any = None) -> PreparedDataset:
    """Prepare (or reuse) ``output_root/<digest>/`` for ``settings``.

    Deterministic: the same source contents, settings and ``tokenizers`` version give the same
    digest and byte-identical shards, tokenizer, indexes and manifest (source URIs aside),
    whatever the number of workers.

    Args:
        output_root: a local folder, or ``s3://bucket/prefix`` (then ``staging_root`` is the
            local folder that holds the local copy the trainer reads).
        s3_client: a boto3 S3 client to use instead of making one from the settings.

    Raises:
        SourceNotFoundError, MalformedRecordError, SourceChangedError, SourceAccessError,
        TokenizerSourceError, EmptyCorpusError, InvalidSettingsError: see
            ``trainforge.data.errors``; all are :class:`DataPrepError`.
        OSError: the output folder cannot be written.
    """
    started = time.monotonic()
    client = (lambda: s3_client) if s3_client is not None else _Client(settings.s3_endpoint_url)
    sources = resolve_sources(settings.sources, client)
    reused = _read_tokenizer(settings, client)
    digest_settings = settings.output_settings()
    if reused is not None:
        digest_settings["tokenizer_sha256"] = hashlib.sha256(reused.data).hexdigest()
    if settings.examples:  # the model's chat template and special tokens render the examples too
        digest_settings["tokenizer_files_sha256"] = tokenizer_files_digest(settings, client)
    digest = dataset_digest(sources=[s.identity() for s in sources], settings=digest_settings,
                            tokenizers_version=tokenizers.__version__)
    log.info("dataset %s: %d source files, %d bytes", digest[:12], len(sources),
             sum(s.bytes for s in sources))

    def build(root: Path) -> PreparedDataset:
        return _prepare_local(settings, sources, digest, root, client, reused, started, log)

    output = storage_for(output_root, client)
    local = output.local_path(output_root)
    if local is not None:
        return build(local.absolute())
    if staging_root is None:
        raise InvalidSettingsError("staging_root", None,
                                   "a local folder for the local copy of an s3:// output")
    return prepare_remote(output, str(output_root), Path(staging_root).absolute(), digest, build,
                          started, log)


def _read_tokenizer(settings: PrepareSettings, client: Any) -> _Reused | None:
    """The reused tokenizer.json (bytes kept as they are: the trainer compares a pretrained
    folder's file by SHA-256), checked; None when one is trained."""
    uri = settings.tokenizer_uri
    if uri is None:
        return None
    if uri.startswith("models:/"):
        raise TokenizerSourceError(uri, "a registered model is fetched by the prepare_data "
                                        "operator (through MLflow); pass its tokenizer.json here")
    if s3.is_s3(uri):
        data = s3.read_bytes(client(), uri)
    else:
        try:
            data = Path(uri).expanduser().read_bytes()
        except OSError as err:
            raise SourceAccessError(uri, "read", str(err.strerror or err),
                                    "check the path of data.tokenizer.source") from err
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TokenizerSourceError(uri, f"not UTF-8 ({err})") from err
    if settings.eos_ids is None:
        assert settings.vocab_size is not None  # PrepareSettings checks it
        tokenizer = load_tokenizer(text, uri=uri, vocab_size=settings.vocab_size,
                                   eos_token=settings.eos_token)
        return _Reused(data, tokenizer, settings.vocab_size)
    tokenizer = load_tokenizer(text, uri=uri, vocab_size=None, eos_token=settings.eos_token,
                               remedy=REMEDY)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos_id = vocab[settings.eos_token]
    missing = [i for i in settings.eos_ids if tokenizer.id_to_token(i) is None]
    if missing or eos_id not in settings.eos_ids:
        problem = (f"eos_ids {list(settings.eos_ids)} hold ids it does not have: {missing}"
                   if missing else f"eos_ids {list(settings.eos_ids)} do not hold the id "
                   f"{eos_id} of the EOS token {settings.eos_token!r}")
        raise TokenizerSourceError(uri, problem, remedy=REMEDY)
    return _Reused(data, tokenizer, max(vocab.values()) + 1)


def _prepare_local(settings: PrepareSettings, sources: list[SourceFile], digest: str,
                   output_root: Path, client: Any, reused: _Reused | None, started: float,
                   log: Log) -> PreparedDataset:
    final = output_root / digest
    if (final / MANIFEST_NAME).exists():
        problems = verify_dataset(final)
        if not problems:
            log.info("dataset %s already prepared at %s; reusing it (nothing re-read or "
                     "re-tokenised)", digest[:12], final)
            return PreparedDataset(final, digest, load_manifest(final), True,
                                   time.monotonic() - started, reuse="local")
        log.warning("dataset %s at %s does not verify (%s); preparing it again",
                    digest[:12], final, "; ".join(problems[:3]))
    output_root.mkdir(parents=True, exist_ok=True)
    work = output_root / f".{digest}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        manifest, timings = _build(settings, sources, digest, work, client, reused, log)
        prepared = _publish(work, final, digest, manifest, started, log)
        prepared.timings_s.update(timings)
        return prepared
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build(settings: PrepareSettings, sources: list[SourceFile], digest: str, work: Path,
           client: Any, reused: _Reused | None, log: Log
           ) -> tuple[dict[str, Any], dict[str, float]]:
    if settings.examples:  # conversations: an examples dataset (trainforge.data.chat_prepare)
        return build_examples(settings, sources, digest, work, client, log)
    spool = work / "spool"
    scan = scan_sources(sources, settings, client, spool,
                        chunk_bytes(settings, sum(s.bytes for s in sources)), log)
    log.info("split by document hash: %d train, %d validation", scan.documents["train"],
             scan.documents["validation"])

    started = time.monotonic()
    tokenizer_path = work / TOKENIZER_NAME
    if reused is not None:
        tokenizer_path.write_bytes(reused.data)
        tokenizer, vocab_size = reused.tokenizer, reused.vocab_size
        log.info("reusing %stokenizer %s (%d tokens, ids < %d)",
                 "the pretrained model's " if settings.pretrained else "",
                 settings.tokenizer_uri, tokenizer.get_vocab_size(), vocab_size)
    else:
        assert settings.vocab_size is not None  # PrepareSettings checks it
        vocab_size = settings.vocab_size
        texts = (r.text.decode("utf-8") for rng in scan.ranges["train"] for r in read_range(rng))
        tokenizer = train_tokenizer(texts, vocab_size=settings.vocab_size,
                                    special_tokens=settings.special_tokens,
                                    length=scan.documents["train"])
        tokenizer_path.write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
        log.info("trained byte-level BPE on the train split: %d tokens (asked %d)",
                 tokenizer.get_vocab_size(), settings.vocab_size)
    tokenizer_seconds = time.monotonic() - started
    tok_bytes, tok_sha = tokenizer_path.stat().st_size, sha256_file(tokenizer_path)
    eos_id = tokenizer.token_to_id(settings.eos_token)
    dtype = dtype_for(vocab_size)

    splits, encode_seconds = encode_splits(
        tokenizer_path, scan.ranges, folder=work, dtype=dtype,
        shard_tokens=settings.shard_tokens, eos_id=eos_id, workers=settings.workers)
    shutil.rmtree(spool)
    for split in SPLITS:
        log.info("%s: %d documents, %d tokens in %d shard(s)", split, splits[split]["documents"],
                 splits[split]["tokens"], len(splits[split]["shards"]))
    tokens = sum(splits[s]["tokens"] for s in SPLITS)
    log.info("encoded %d tokens with %d worker(s) in %.1f s (%.0f tokens/s)", tokens,
             settings.workers, encode_seconds, tokens / max(encode_seconds, 1e-9))
    manifest = _manifest(settings, sources, digest, scan, splits,
                         {"dtype": dtype, "vocab_size": vocab_size,
                          "eos_token": settings.eos_token, "eos_id": eos_id,
                          "eos_ids": list(settings.eos_ids or [eos_id])},
                         {"file": TOKENIZER_NAME, "bytes": tok_bytes, "sha256": tok_sha,
                          "trained_vocab_size": tokenizer.get_vocab_size(),
                          "source": settings.tokenizer_uri})
    return manifest, {"scan": scan.seconds, "tokenizer": tokenizer_seconds,
                      "encode": encode_seconds}


def _manifest(settings: PrepareSettings, sources: list[SourceFile], digest: str,
              scan: ScanResult, splits: dict[str, Any], vocabulary: dict[str, Any],
              tokenizer: dict[str, Any]) -> dict[str, Any]:
    """The manifest; ``vocabulary``: dtype, vocab_size, eos_token, eos_id, eos_ids."""
    entries = []
    for s in sources:
        entry: dict[str, Any] = {"uri": s.uri, "name": s.name, "bytes": s.bytes,
                                 "sha256": s.sha256 or scan.source_sha256.get(s.location, "")}
        if s.etag:
            entry["etag"] = s.etag
        entries.append(entry)
    return {
        "format": FORMAT,
        "digest": digest,
        **vocabulary,
        "tokenizer": tokenizer,
        "splits": splits,
        "sources": entries,
        "source_patterns": list(settings.sources),
        "settings": settings.output_settings(),
        "recipe": RECIPE_VERSION,
        "tokenizers_version": tokenizers.__version__,
        "stats": {"documents_in": scan.documents_in, "removed": scan.removed,
                  "malformed": scan.malformed.as_dict(), "cleaning": scan.counts.as_dict()},
    }


def _publish(work: Path, final: Path, digest: str, manifest: dict[str, Any], started: float,
             log: Log) -> PreparedDataset:
    """Write the manifest last, then move the folder into place (see module doc)."""
    atomic_write_json(work / MANIFEST_NAME, manifest, ensure_ascii=False, allow_nan=False)
    fsync_dir(work)
    if final.exists():  # a broken earlier attempt, or another process that just finished
        if not verify_dataset(final):
            log.info("dataset %s was completed by another process; reusing it", digest[:12])
            return PreparedDataset(final, digest, load_manifest(final), True,
                                   time.monotonic() - started, reuse="local")
        broken = final.with_name(f".{digest}.broken-{os.getpid()}")
        os.replace(final, broken)
        shutil.rmtree(broken, ignore_errors=True)
    try:
        os.replace(work, final)
    except OSError:
        if final.exists() and not verify_dataset(final):  # lost a race to an identical result
            return PreparedDataset(final, digest, load_manifest(final), True,
                                   time.monotonic() - started, reuse="local")
        raise
    fsync_dir(final.parent)
    elapsed = time.monotonic() - started
    log.info("dataset %s ready at %s in %.1f s", digest[:12], final, elapsed)
    return PreparedDataset(final, digest, manifest, False, elapsed)
