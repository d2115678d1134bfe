"""Settings of one dataset preparation: everything that changes the output.

The pipeline spec (``trainforge.pipeline``) owns the user-facing defaults; this dataclass has none for
tunable values, only the EOS token fixed by ``docs/contracts.md`` for the tokenizers trainforge
trains (a pretrained model's tokenizer brings its own: ``eos_ids``).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from trainforge.data.errors import InvalidSettingsError

#: End-of-document token; id 0 in every tokenizer (docs/contracts.md, "Dataset").
EOS_TOKEN = "<|endoftext|>"

#: Byte-level BPE starts from the 256 byte symbols; the special tokens come on top.
BYTE_ALPHABET_SIZE = 256

#: Largest id that fits the uint32 shard dtype (2**32 ids).
MAX_VOCAB_SIZE = 2**32

#: Longest document (characters after cleaning) the spool format and the readers accept.
MAX_DOCUMENT_CHARS = 100_000_000

UnicodeNormalization = Literal["NFC", "NFKC", "none"]
SourceFormat = Literal["text", "jsonl", "parquet", "auto", "chat", "prompt_completion"]
#: Formats whose records are conversations: prepared into an examples dataset (trainforge.data.chat).
EXAMPLE_FORMATS = ("chat", "prompt_completion")
Compression = Literal["auto", "none", "gzip", "zstd"]
OnMalformed = Literal["fail", "skip"]

#: Settings that change how the work is done but never the bytes written: kept out of the
#: digest, so that e.g. more workers reuse the dataset that fewer workers made.
_RUNTIME_ONLY = ("sources", "tokenizer_uri", "encode_workers", "memory_budget_mib",
                 "s3_endpoint_url")


@dataclass(frozen=True, kw_only=True)
class PrepareSettings:
    """How to turn source files into a tokenized dataset (docs/data.md lists every option).

    Attributes:
        sources: glob patterns of local files (absolute or relative to the current directory) or
            ``s3://bucket/prefix/*.jsonl.gz`` URIs; ``**`` recurses. Files are identified in the
            digest by their path relative to the patterns' common base folder and their content
            (local: SHA-256; S3: size and ETag), so the same corpus elsewhere gives the same
            dataset.
        format: ``text`` (one document per file), ``jsonl`` (one JSON object per line, the
            document in ``text_field``), ``parquet`` (the document in column ``text_field``), or
            ``auto``: by suffix before any compression suffix (``.jsonl``/``.ndjson`` JSONL,
            ``.parquet``/``.pq`` Parquet, anything else text).
        compression: ``auto`` (by suffix: ``.gz`` gzip, ``.zst``/``.zstd`` zstd), or forced.
        text_field: JSONL key / Parquet column holding the document text.
        on_malformed: ``fail`` raises :class:`MalformedRecordError` at the first unreadable
            record (naming file and line or row group); ``skip`` counts and skips them.
        strip_gutenberg_boilerplate: drop Project Gutenberg licence headers, footers and the
            ``<<THIS ELECTRONIC VERSION ...>>`` notices (see ``trainforge.data.clean``).
        normalize_whitespace: collapse runs of horizontal whitespace to one space, strip
            trailing whitespace, collapse runs of blank lines to one blank line, trim blank lines
            at both ends.
        unicode_normalization: Unicode normal form applied to every line (``"none"`` to skip).
        min_document_chars: documents shorter than this (characters, after cleaning) are dropped.
        max_document_chars: documents longer than this (characters, after cleaning) are dropped;
            also bounds the memory one document may take while it is read.
        deduplicate: drop documents whose cleaned text equals an earlier one (SHA-256).
        vocab_size: BPE vocabulary size including the EOS token (>= 257); also the model's
            embedding size. Shards are uint16 when ``vocab_size <= 65536``, else uint32.
            None (only with ``eos_ids``): a pretrained tokenizer's largest id + 1 sets it.
        tokenizer_uri: reuse this ``tokenizer.json`` (local path or ``s3://``) instead of
            training one; its SHA-256, not the URI, enters the digest.
        validation_fraction: expected share of documents in the validation split, in (0, 1).
        shard_tokens: maximum tokens per shard file.
        encode_workers: encoding worker processes (one tokenizer thread each); 0: one per CPU
            this process may use. The output does not depend on it.
        memory_budget_mib: memory (MiB) the step may use for text in flight: sizes the chunks
            the workers encode. Does not bound one document (see ``max_document_chars``) nor the
            tokenizer trainer's word counts.
        s3_endpoint_url: S3 endpoint (e.g. MinIO); None: ``AWS_ENDPOINT_URL`` or AWS itself.
        messages_field, prompt_field, completion_field: where a ``chat`` record keeps its
            messages and a ``prompt_completion`` record its two strings.
        chat_template: a Jinja chat template to render with instead of the tokenizer's own.
        sequence_length: ``chat``/``prompt_completion``: the most tokens one example may have.
        over_length: an example longer than that: ``drop`` it, or ``truncate`` its last answer
            (an example whose prompt alone is too long is dropped either way); both counted.
        eos_token: end-of-document token, written after every document.
        eos_ids: a pretrained model's tokenizer (``tokenizer_uri``, required then): every EOS
            id the model declares, the id of ``eos_token`` among them
            (:func:`trainforge.data.model_tokenizer.model_eos`). None: trainforge's own
            tokenizer, whose EOS is id 0 (trained) or ``eos_token``'s id (reused).
    """

    sources: tuple[str, ...]
    strip_gutenberg_boilerplate: bool
    normalize_whitespace: bool
    unicode_normalization: UnicodeNormalization
    min_document_chars: int
    vocab_size: int | None
    validation_fraction: float
    shard_tokens: int
    format: SourceFormat = "text"
    compression: Compression = "auto"
    text_field: str = "text"
    on_malformed: OnMalformed = "fail"
    max_document_chars: int = MAX_DOCUMENT_CHARS
    deduplicate: bool = True
    tokenizer_uri: str | None = None
    encode_workers: int = 1
    memory_budget_mib: int = 1024
    s3_endpoint_url: str | None = None
    eos_token: str = field(default=EOS_TOKEN)
    eos_ids: tuple[int, ...] | None = None
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chat_template: str | None = None
    sequence_length: int | None = None
    over_length: Literal["drop", "truncate"] = "drop"

    def __post_init__(self) -> None:
        if isinstance(self.sources, str) or not all(isinstance(s, str) for s in self.sources):
            raise InvalidSettingsError("sources", self.sources, "a list of glob pattern strings")
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.sources or any(not s.strip() for s in self.sources):
            raise InvalidSettingsError("sources", self.sources, "at least one non-empty pattern")
        for name in ("strip_gutenberg_boilerplate", "normalize_whitespace", "deduplicate"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSettingsError(name, getattr(self, name), "true or false")
        for name, allowed in (("unicode_normalization", ("NFC", "NFKC", "none")),
                              ("format", ("text", "jsonl", "parquet", "auto", *EXAMPLE_FORMATS)),
                              ("over_length", ("drop", "truncate")),
                              ("compression", ("auto", "none", "gzip", "zstd")),
                              ("on_malformed", ("fail", "skip"))):
            if getattr(self, name) not in allowed:
                expected = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
                raise InvalidSettingsError(name, getattr(self, name), expected)
        for name in ("text_field", "messages_field", "prompt_field", "completion_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise InvalidSettingsError(name, getattr(self, name), "a non-empty string")
        if self.examples:
            self._check_examples()
        _check_int("min_document_chars", self.min_document_chars, 1)
        _check_int("max_document_chars", self.max_document_chars, self.min_document_chars,
                   MAX_DOCUMENT_CHARS, why="(and >= min_document_chars)")
        _check_int("shard_tokens", self.shard_tokens, 1)
        _check_int("encode_workers", self.encode_workers, 0, 1024)
        _check_int("memory_budget_mib", self.memory_budget_mib, 16)
        for name in ("tokenizer_uri", "s3_endpoint_url"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidSettingsError(name, value, "null or a non-empty string")
        if not isinstance(self.eos_token, str) or not self.eos_token:
            raise InvalidSettingsError("eos_token", self.eos_token, "a non-empty string")
        if self.eos_ids is not None:
            self._check_pretrained()
        else:
            minimum_vocab = BYTE_ALPHABET_SIZE + len(self.special_tokens)
            _check_int("vocab_size", self.vocab_size, minimum_vocab, MAX_VOCAB_SIZE,
                       why=f"(256 byte symbols + {len(self.special_tokens)} special token)")
        fraction = self.validation_fraction
        if (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                or not math.isfinite(fraction) or not 0.0 < fraction < 1.0):
            raise InvalidSettingsError(
                "validation_fraction", fraction, "a number strictly between 0 and 1"
            )
        object.__setattr__(self, "validation_fraction", float(fraction))

    def _check_pretrained(self) -> None:
        ids = self.eos_ids
        if (isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__")
                or not (ids := tuple(ids))
                or not all(isinstance(i, int) and not isinstance(i, bool)
                           and 0 <= i < MAX_VOCAB_SIZE for i in ids)
                or len(set(ids)) != len(ids)):
            raise InvalidSettingsError("eos_ids", self.eos_ids,
                                       "a non-empty list of distinct token ids (integers >= 0)")
        object.__setattr__(self, "eos_ids", ids)
        if self.tokenizer_uri is None:
            raise InvalidSettingsError("tokenizer_uri", None, "the pretrained model's "
                                       "tokenizer.json (eos_ids is set)")
        if self.vocab_size is not None:
            raise InvalidSettingsError("vocab_size", self.vocab_size, "null with eos_ids (a "
                                       "pretrained tokenizer's largest id sets the size)")

    def _check_examples(self) -> None:
        _check_int("sequence_length", self.sequence_length, 2, why=f"(format {self.format!r} needs it)")
        if self.eos_ids is None:
            raise InvalidSettingsError("eos_ids", None, f"a pretrained model's tokenizer: format {self.format!r} "
                                       "renders conversations with a model's tokenizer and chat template")
        if self.chat_template is not None and (not isinstance(self.chat_template, str)
                                               or not self.chat_template.strip()):
            raise InvalidSettingsError("chat_template", self.chat_template, "null or a Jinja template's text")

    @property
    def examples(self) -> bool:
        """True for conversation formats, prepared into an examples dataset."""
        return self.format in EXAMPLE_FORMATS

    @property
    def pretrained(self) -> bool:
        """True when encoding with a pretrained model's tokenizer (``eos_ids`` is set)."""
        return self.eos_ids is not None

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Special tokens in id order; the EOS token is id 0 of a trained tokenizer."""
        return (self.eos_token,)

    @property
    def dtype(self) -> str:
        """Shard dtype name of ``vocab_size`` (:func:`dtype_for`); a pretrained tokenizer's
        comes from its largest id, known once it is read."""
        if self.vocab_size is None:
            raise ValueError("a pretrained tokenizer's dtype comes from its ids (dtype_for)")
        return dtype_for(self.vocab_size)

    @property
    def workers(self) -> int:
        """Encoding worker processes, ``encode_workers`` with 0 resolved to the usable CPUs."""
        if self.encode_workers:
            return self.encode_workers
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)

    def output_settings(self) -> dict[str, Any]:
        """The settings that enter the digest and the manifest: all that change the output
        bytes. Left out: the source patterns (the matched files themselves, by relative name
        and content, stand for those), the tokenizer URI (its SHA-256 stands for it), and the
        runtime-only knobs (workers, memory budget, endpoint)."""
        values = asdict(self)
        for name in _RUNTIME_ONLY:
            del values[name]
        if self.format == "text":
            del values["text_field"]  # not read for plain text
        if not self.examples:  # the digests of text datasets stay what they were
            for name in ("messages_field", "prompt_field", "completion_field", "chat_template", "sequence_length",
                         "over_length"):
                del values[name]
        elif self.chat_template is not None:  # its hash stands for it (the manifest stays small)
            values["chat_template"] = "sha256:" + hashlib.sha256(self.chat_template.encode()).hexdigest()
        if self.eos_ids is None:  # trainforge's own tokenizer: the digests of earlier versions
            del values["eos_ids"]
        else:
            del values["vocab_size"]  # the tokenizer's sha256 stands for its ids
            values["eos_ids"] = list(self.eos_ids)
        return values


def dtype_for(vocab_size: int) -> str:
    """``uint16`` when every id below ``vocab_size`` fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _check_int(name: str, value: object, low: int, high: int | None = None, why: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value <= high  # type: ignore[operator]
    if not ok:
        expected = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        raise InvalidSettingsError(name, value, f"{expected} {why}".strip())
