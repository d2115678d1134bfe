"""Prepare an examples dataset from conversation records (``data.format: chat`` or
``prompt_completion``; docs/finetuning.md, docs/contracts.md "Examples datasets").

    sources (JSONL or Parquet) ─► records ─► messages (trainforge.data.chat.messages_of)
        ─► dedup and split by conversation (the SHA-256 of its messages, as documents are split)
        ─► render with the model's chat template: ids + loss mask ─► over-length policy
        ─► shards, masks, offsets, manifest (trainforge.data.examples)

One process, examples held in memory as arrays (chat data is small next to a pretraining
corpus). A record that is not a conversation is malformed (``on_malformed``: fail naming file,
line or row, and field; or skip and count); a template no loss mask can be built from fails the
whole step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainforge.data.chat import ChatRecordError, ChatRenderer, ChatTemplateError, messages_of
from trainforge.data.errors import InvalidSettingsError, MalformedRecordError, TokenizerSourceError
from trainforge.data.examples import write_split
from trainforge.data.formats import MalformedLog, _decompress_errors, line_limit, parquet_file
from trainforge.data.manifest import FORMAT, RECIPE_VERSION, canonical_json
from trainforge.data.model_tokenizer import TOKENIZER_CONFIG, TOKENIZER_FILE, TOKENIZER_FILES, read_model_files
from trainforge.data.settings import PrepareSettings
from trainforge.data.sources import SourceFile, check_unchanged, decompressed, open_raw
from trainforge.data.split import hash_fraction
from trainforge.storage.files import sha256_file

Log = logging.Logger | logging.LoggerAdapter
#: The chat template a dataset was rendered with, beside its shards.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: What a chat template should be, for an error about one.
TEMPLATE_RULES = ("a Jinja chat template whose generation prompt ends where each answer begins and that closes "
                  "each assistant turn with a special token (docs/finetuning.md)")


def template_error(settings: PrepareSettings, problem: str) -> TokenizerSourceError:
    """A template no loss mask fits, naming whose it is: the spec's data.chat_template (to fix),
    or the model's own (to replace with data.chat_template)."""
    if settings.chat_template is not None:
        return TokenizerSourceError("data.chat_template", problem, remedy=f"fix data.chat_template: {TEMPLATE_RULES}")
    return TokenizerSourceError(f"the chat template of {settings.tokenizer_uri}", problem,
                                remedy=f"give data.chat_template: {TEMPLATE_RULES}")
#: Parquet rows read per batch.
_PARQUET_BATCH_ROWS = 256


def _model_folder(settings: PrepareSettings) -> str:
    uri = str(settings.tokenizer_uri)
    return uri[: -len(TOKENIZER_FILE)].rstrip("/") or "."


def tokenizer_files_digest(settings: PrepareSettings, client: Any) -> dict[str, str | None]:
    """SHA-256 of each tokenizer file beside tokenizer.json (its config, special tokens, chat
    template; None when absent): they change the rendering, so they enter the dataset digest."""
    folder = _model_folder(settings)
    files = read_model_files(folder, client() if folder.startswith("s3://") else None, TOKENIZER_FILES)
    return {name: None if data is None else hashlib.sha256(data).hexdigest()
            for name, data in files.items() if name != TOKENIZER_FILE}


def load_renderer(settings: PrepareSettings, work: Path, client: Any) -> ChatRenderer:
    """The pretrained model's tokenizer (its folder's tokenizer.json and tokenizer_config.json,
    copied into ``work``) with the spec's chat template, or the tokenizer's own.

    Raises:
        TokenizerSourceError: the tokenizer does not load, or has no chat template and the spec
            gives none, or the template cannot give a loss mask (found on the first record).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    uri, folder = str(settings.tokenizer_uri), _model_folder(settings)
    files = read_model_files(folder, client() if uri.startswith("s3://") else None, TOKENIZER_FILES)
    local = work / "chat-tokenizer"
    local.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if data is not None:
            (local / name).write_bytes(data)
    try:
        if files.get(TOKENIZER_CONFIG):
            tokenizer = AutoTokenizer.from_pretrained(str(local), local_files_only=True)
        else:  # a tokenizer.json alone (trainforge's own models): its EOS from the settings
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(local / TOKENIZER_FILE),
                                                eos_token=settings.eos_token)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a bad folder
        raise TokenizerSourceError(uri, f"does not load as a transformers tokenizer ({type(err).__name__}: "
                                        f"{err})") from err
    try:
        return ChatRenderer(tokenizer, settings.chat_template)
    except ChatTemplateError as err:
        raise template_error(settings, str(err)) from err


def read_records(source: SourceFile, settings: PrepareSettings, client_factory: Any, malformed: MalformedLog,
                 tmp_dir: Path) -> Iterator[tuple[str, Any]]:
    """``(location, record)`` of each record of a JSONL or Parquet source, in order; a line
    that is not JSON goes to ``malformed``. Plain-text sources are malformed as a whole."""
    kind = source.format("auto")
    client = client_factory() if source.is_s3 else None
    if kind == "parquet":
        yield from _parquet_records(source, settings, client, malformed, tmp_dir)
        return
    if kind != "jsonl":
        malformed.report(MalformedRecordError(source.uri, "file", f"format {settings.format!r} reads JSONL "
                                              "(.jsonl, .ndjson) or Parquet (.parquet, .pq) files, optionally "
                                              ".gz or .zst; this file's name says neither"))
        return
    compression = source.compression(settings.compression)
    raw = open_raw(source, client)
    try:
        stream = decompressed(raw, compression)
        limit, number = line_limit(settings), 0
        try:
            while line := stream.readline(limit):
                number += 1
                if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
                if not line.strip():
                    continue
                try:
                    yield f"line {number}", json.loads(line)
                except ValueError as err:
                    detail = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else err
                    malformed.report(MalformedRecordError(source.uri, f"line {number}", f"not JSON ({detail})"))
        except _decompress_errors() as err:
            if compression == "none":
                raise
            malformed.report(MalformedRecordError(source.uri, f"compressed byte {raw.count}",
                                                  f"cannot decompress ({err})"))
        raw.drain()
    finally:
        raw.release()
    check_unchanged(source, raw)


def _parquet_records(source: SourceFile, settings: PrepareSettings, client: Any, malformed: MalformedLog,
                     tmp_dir: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa

    with parquet_file(source, source.compression(settings.compression), client, malformed,
                      tmp_dir) as (parquet, raw):
        if parquet is None:
            return
        for group in range(parquet.num_row_groups):
            row = 0
            try:
                for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[group],
                                                  use_threads=False):
                    for record in batch.to_pylist():
                        yield f"row group {group}, row {row}", record
                        row += 1
            except (pa.ArrowException, OSError) as err:
                malformed.report(MalformedRecordError(source.uri, f"row group {group}, row {row}",
                                                      f"unreadable ({err})"))
    check_unchanged(source, raw)


def build_examples(settings: PrepareSettings, sources: list[SourceFile], digest: str, work: Path, client: Any,
                   log: Log) -> tuple[dict[str, Any], dict[str, float]]:
    """Write the examples dataset of ``sources`` into ``work`` (all but the manifest, which is
    returned for the caller to publish last); returns it and the timings."""
    started = time.monotonic()
    renderer = load_renderer(settings, work, client)
    tokenizer = renderer.tokenizer
    (work / TOKENIZER_FILE).write_bytes((work / "chat-tokenizer" / TOKENIZER_FILE).read_bytes())
    malformed = MalformedLog(settings.on_malformed)
    seen: set[str] = set()
    kept: dict[str, list[tuple[np.ndarray, np.ndarray, int, bytes]]] = {"train": [], "validation": []}
    counts = {"records": 0, "duplicate": 0, "dropped": 0, "truncated": 0}
    fields = dict(messages_field=settings.messages_field, prompt_field=settings.prompt_field,
                  completion_field=settings.completion_field)
    limit = int(settings.sequence_length or 0)
    for source in sources:
        for where, record in read_records(source, settings, client, malformed, work):
            counts["records"] += 1
            try:
                messages = messages_of(record, settings.format, **fields)
                rendered = renderer.render(messages)
            except ChatRecordError as err:
                field = err.field if err.field != "messages" else settings.messages_field
                malformed.report(MalformedRecordError(source.uri, where, f"field {field}: {err.reason}"))
                continue
            except ChatTemplateError as err:
                raise template_error(settings, f"{err} (first seen on {source.uri} at {where})") from err
            key = hashlib.sha256(canonical_json(messages)).digest()
            if settings.deduplicate and key.hex() in seen:
                counts["duplicate"] += 1
                continue
            seen.add(key.hex())
            if len(rendered.ids) > limit:
                cut = rendered.truncated(limit) if settings.over_length == "truncate" else None
                if cut is None:
                    counts["dropped"] += 1
                    continue
                counts["truncated"] += 1
                rendered = cut
            split = "validation" if hash_fraction(key) < settings.validation_fraction else "train"
            text_bytes = sum(len(m["content"].encode()) for m in messages)
            kept[split].append((np.asarray(rendered.ids, np.int64), np.asarray(rendered.mask, np.uint8),
                                text_bytes, key))
    _fill_empty_split(kept)
    render_s = time.monotonic() - started
    for split, examples in kept.items():
        log.info("%s: %d examples, %d tokens, %d loss tokens", split, len(examples),
                 sum(len(e[0]) for e in examples), sum(int(e[1].sum()) for e in examples))
    vocab = tokenizer.get_vocab()
    vocab_size = max(vocab.values()) + 1
    eos_id = vocab[settings.eos_token]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    splits = {name: write_split(work, name, ((i, m, b) for i, m, b, _ in examples), dtype, settings.shard_tokens)
              for name, examples in kept.items()}
    tokenizer_path = work / TOKENIZER_FILE
    template_path = work / CHAT_TEMPLATE_FILE  # what the export gives the trained model's tokenizer
    template_path.write_bytes(renderer.template.encode("utf-8"))
    manifest = {
        "format": FORMAT, "digest": digest, "dtype": dtype, "vocab_size": vocab_size,
        "eos_token": settings.eos_token, "eos_id": eos_id, "eos_ids": list(settings.eos_ids or [eos_id]),
        "tokenizer": {"file": TOKENIZER_FILE, "bytes": tokenizer_path.stat().st_size,
                      "sha256": sha256_file(tokenizer_path), "source": settings.tokenizer_uri},
        "splits": splits,
        "examples": {"kind": settings.format, "chat_template_sha256": renderer.template_sha256,
                     "chat_template": {"file": CHAT_TEMPLATE_FILE, "bytes": template_path.stat().st_size,
                                       "sha256": sha256_file(template_path)},
                     "sequence_length": limit, "pad_id": int(pad_id),
                     "over_length": {"policy": settings.over_length, "dropped": counts["dropped"],
                                     "truncated": counts["truncated"]}},
        "sources": [{"uri": s.uri, "name": s.name, "bytes": s.bytes, "sha256": s.sha256,
                     **({"etag": s.etag} if s.etag else {})} for s in sources],
        "source_patterns": list(settings.sources),
        "settings": settings.output_settings(),
        "recipe": RECIPE_VERSION,
        "stats": {"documents_in": counts["records"], "removed": {"duplicate": counts["duplicate"],
                                                                 "too_long": counts["dropped"]},
                  "malformed": malformed.as_dict(), "cleaning": {}},  # conversations are taken as written
    }
    shutil.rmtree(work / "chat-tokenizer", ignore_errors=True)
    return manifest, {"render": render_s, "write": time.monotonic() - started - render_s}


def _fill_empty_split(kept: dict[str, list]) -> None:
    """Neither split empty (the documents' rule, trainforge.data.split): with no validation
    example the train example of the smallest hash moves over, and the other way round.

    Raises:
        InvalidSettingsError: fewer than two examples in all.
    """
    total = len(kept["train"]) + len(kept["validation"])
    if total < 2:
        raise InvalidSettingsError("sources", f"{total} usable conversation(s)",
                                   "at least 2 (one for training, one for validation)")
    for empty, full, pick in (("validation", "train", min), ("train", "validation", max)):
        if not kept[empty]:
            index = pick(range(len(kept[full])), key=lambda i: kept[full][i][3])
            kept[empty].append(kept[full].pop(index))
