"""The ``data`` section of a pipeline spec: sources and formats, cleaning, tokenizer, encoding.

Relative paths resolve against ``TRAINFORGE_HOME`` (see :mod:`trainforge.paths`). Every option,
with examples, is in docs/data.md. Credentials never go here: S3 access uses the Airflow
connection named by ``storage.aws_conn_id`` (:class:`StorageSection`), else the standard AWS
chain (environment, ``~/.aws``, instance or pod role).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainforge.contract import S3_URI
from trainforge.sections import SpecModel, check_length, field_errors

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
_MODELS = re.compile(r"^models:/([^/@]+)(@[A-Za-z_][A-Za-z0-9_\-]*|/[0-9]+)$")
_ENDPOINT = re.compile(r"^https?://[^/@\s]+(:[0-9]+)?/?$")
#: Longest document the data step accepts (characters), as trainforge.data.settings.
MAX_DOCUMENT_CHARS = 100_000_000


def _check_location(value: str, what: str) -> str:
    """A local path, or an ``s3://bucket/...`` URI; other schemes are errors."""
    match = _SCHEME.match(value)
    if match and match.group(1) != "s3":
        raise ValueError(f"{what} must be a local path or an s3:// URI (got {value!r}; "
                         f"expected e.g. 'corpus/*.txt' or 's3://bucket/prefix/*.jsonl.gz')")
    if match and not S3_URI.match(value):
        raise ValueError(f"not an s3://bucket/key URI (got {value!r}; expected s3:// followed "
                         "by a bucket name of 3-63 lower-case letters, digits, '.' or '-')")
    return value


class CleaningSection(SpecModel):
    strip_gutenberg_boilerplate: bool = Field(
        False, description="Drop Project Gutenberg licence headers, footers and notices."
    )
    normalize_whitespace: bool = Field(
        True, description="Collapse runs of blanks to one space and of blank lines to one; trim "
        "trailing blanks and blank lines at both ends."
    )
    unicode_normalization: Literal["NFC", "NFKC", "none"] = Field(
        "NFC", description="Unicode normal form applied to every line."
    )
    min_document_chars: int = Field(
        1, ge=1, description="Drop documents shorter than this many characters after cleaning."
    )
    max_document_chars: int = Field(
        10_000_000, ge=1, le=MAX_DOCUMENT_CHARS, description="Drop documents longer than this "
        "many characters after cleaning; also bounds the memory one document takes while read."
    )
    deduplicate: bool = Field(
        True, description="Drop exact duplicates: a document whose cleaned text has the SHA-256 "
        "of an earlier one, across all files and formats."
    )

    @model_validator(mode="after")
    def _lengths(self) -> CleaningSection:
        if self.max_document_chars < self.min_document_chars:
            raise field_errors(CleaningSection, (
                ("max_document_chars",), f"max_document_chars must be >= min_document_chars (got "
                f"{self.max_document_chars} < {self.min_document_chars})",
                self.max_document_chars, ("min_document_chars",)))
        return self


class TokenizerSection(SpecModel):
    vocab_size: int = Field(
        4096, ge=300, le=1_048_576, description="Byte-level BPE vocabulary size, trained on the "
        "train split; also the model's embedding size. <= 65536 stores tokens as uint16, else "
        "uint32. With source set, at least the reused tokenizer's size."
    )
    source: str | None = Field(
        None, description="Reuse this tokenizer instead of training one, so continued training "
        "keeps its vocabulary: a tokenizer.json as a local path or s3:// URI, or a registered "
        "model 'models:/<name>@<alias>' or 'models:/<name>/<version>' (its tokenizer.json "
        "artifact). Must contain the EOS token '<|endoftext|>'. null: train one."
    )

    @field_validator("source")
    @classmethod
    def _source(cls, value: str | None) -> str | None:
        if value is None or _MODELS.match(value):
            return value
        if value.startswith("models:"):
            raise ValueError(f"a registered model is 'models:/<name>@<alias>' or "
                             f"'models:/<name>/<version>' (got {value!r})")
        return _check_location(value, "tokenizer.source")


class DataSection(SpecModel):
    sources: list[str] = Field(
        min_length=1,
        description="Glob patterns of input files: local paths (relative ones resolve against "
        "TRAINFORGE_HOME) or s3://bucket/prefix/... URIs; '**' matches any folders.",
    )
    format: Literal["text", "jsonl", "parquet", "auto", "chat", "prompt_completion"] = Field(
        "text", description="text: one document per file; jsonl: one JSON object per line, the "
        "document under text_field; parquet: the document in column text_field; auto: each "
        "file by suffix (.jsonl/.ndjson, .parquet/.pq, else text; before .gz/.zst). For "
        "fine-tuning (needs model.pretrained), JSONL or Parquet records by suffix: chat: a list "
        "of {role, content} messages under messages_field; prompt_completion: the strings under "
        "prompt_field and completion_field. Rendered with the chat template, the loss counts "
        "only the assistant's tokens (docs/finetuning.md)."
    )
    messages_field: str = Field(
        "messages", min_length=1, description="format chat: the field (JSONL key or Parquet column) "
        "holding the list of messages; roles system, user, assistant and tool."
    )
    prompt_field: str = Field(
        "prompt", min_length=1, description="format prompt_completion: the field of the prompt "
        "(rendered as a user turn)."
    )
    completion_field: str = Field(
        "completion", min_length=1, description="format prompt_completion: the field of the "
        "completion (rendered as the assistant's answer, which the loss counts)."
    )
    chat_template: str | None = Field(
        None, description="A Jinja chat template file (local path) to render conversations with, "
        "instead of the tokenizer's own (for a tokenizer without one). null: the model's."
    )
    over_length: Literal["drop", "truncate"] = Field(
        "drop", description="A conversation longer than sequence_length tokens: drop it, or "
        "truncate its last answer (one whose prompt alone is too long is dropped). Both counted "
        "in the dataset manifest."
    )
    packing: bool = Field(
        False, description="format chat or prompt_completion: pack several examples into each "
        "training sequence of sequence_length tokens (no token attends to another example; "
        "position ids restart per example) instead of padding one example per sequence; "
        "training.optimization's batch sizes then count packed sequences. Validation stays "
        "one example per sequence."
    )
    compression: Literal["auto", "none", "gzip", "zstd"] = Field(
        "auto", description="auto: by file suffix (.gz gzip, .zst/.zstd zstd, else none)."
    )
    text_field: str = Field(
        "text", min_length=1, description="JSONL key or Parquet column holding the document text."
    )
    on_malformed: Literal["fail", "skip"] = Field(
        "fail", description="A record that cannot be read (bad UTF-8 or JSON, missing or "
        "non-string text, unreadable row group): fail the task naming file and line or row "
        "group, or skip it (counted, first 20 listed in the manifest)."
    )
    s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (e.g. http://minio:9000) for sources, "
        "tokenizer and output. null: AWS_ENDPOINT_URL, else AWS. Never put credentials here."
    )
    cleaning: CleaningSection = CleaningSection()
    tokenizer: TokenizerSection = TokenizerSection()
    sequence_length: int = Field(256, ge=8, le=131_072, description="Tokens per training sequence.")
    validation_fraction: float = Field(
        0.1, gt=0.0, lt=0.5, description="Expected share of documents held out for validation "
        "(chosen by a hash of each document's text)."
    )
    shard_tokens: int = Field(
        16_777_216, ge=1024, description="Maximum tokens per shard file."
    )
    encode_workers: int = Field(
        0, ge=0, le=256, description="Worker processes that encode in parallel, one tokenizer "
        "thread each; 0: one per CPU the task may use. The output does not depend on it."
    )
    memory_budget_mib: int = Field(
        1024, ge=64, le=1_048_576, description="MiB of text the step keeps in flight while "
        "encoding (sizes the work chunks). The corpus itself is streamed from disk, whatever its "
        "size. Not counted: one document (max_document_chars) and the tokenizer trainer's word "
        "counts."
    )
    output_uri: str = Field(
        "datasets", description="Where prepared datasets go (one folder per dataset digest): a "
        "local folder, or s3://bucket/prefix (prepared in TRAINFORGE_HOME/staging, then uploaded, "
        "manifest last)."
    )

    @field_validator("sources")
    @classmethod
    def _sources(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not pattern.strip():
                raise ValueError(f"a source pattern may not be empty (got {pattern!r})")
            _check_location(pattern, "each source")
        return value

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is not None and _SCHEME.match(value):
            raise ValueError(f"data.chat_template is a local Jinja file (got {value!r}; expected e.g. "
                             "'templates/chat.jinja', relative to TRAINFORGE_HOME)")
        return value

    @model_validator(mode="after")
    def _chat_fields(self) -> DataSection:
        if self.format in ("chat", "prompt_completion"):
            return self
        given = [name for name in ("chat_template", "packing") if getattr(self, name) not in (None, False)]
        if given:
            raise field_errors(DataSection, ((given[0],), f"{given[0]} is only read with format chat or "
                               f"prompt_completion (got format {self.format!r})", getattr(self, given[0]),
                               ("format",)))
        return self

    @field_validator("output_uri")
    @classmethod
    def _output(cls, value: str) -> str:
        return _check_location(value, "output_uri")

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and not _ENDPOINT.match(value):
            raise ValueError(f"an endpoint is http(s)://host[:port] without user or password "
                             f"(got {value!r})")
        return value


#: An Airflow connection id: letters, digits, '_', '-' and '.'.
_CONN_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,249}$")


def same_endpoint(a: str | None, b: str | None) -> bool:
    """Whether two endpoint URLs name the same server (a trailing ``/`` and the case of the
    scheme and host do not count). ``None`` matches anything."""
    if a is None or b is None:
        return True
    return a.rstrip("/").lower() == b.rstrip("/").lower()


class StorageSection(SpecModel):
    """How every S3 client reaches S3 (docs/storage.md); credentials never go in a spec."""

    aws_conn_id: str | None = Field(
        None, description="Airflow connection of type 'aws' whose login (access key id), "
        "password (secret access key) and extra (region_name, endpoint_url, aws_session_token) "
        "data preparation, the local and ray trainers, validation and registration use for S3. "
        "Not allowed with the kubernetes and slurm engines (use training.kubernetes.secret_env "
        "or the cluster's own credentials). null: boto3's standard chain (environment, ~/.aws, "
        "instance or pod role)."
    )
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (e.g. http://minio:9000) for every S3 client "
        "of the pipeline, the trainer's ranks included (AWS_ENDPOINT_URL_S3). Same meaning as "
        "data.s3_endpoint_url; give it in one place, or the same value in both. null: the "
        "connection's endpoint_url, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS."
    )

    @field_validator("aws_conn_id")
    @classmethod
    def _conn_id(cls, value: str | None) -> str | None:
        if value is not None:
            check_length(value, 250, "an Airflow connection id")
        if value is not None and not _CONN_ID.match(value):
            raise ValueError(f"not an Airflow connection id (got {value!r}; expected letters, "
                             f"digits, '_', '-' and '.', e.g. 'aws_default'; credentials never "
                             f"go in the spec)")
        return value

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and not _ENDPOINT.match(value):
            raise ValueError(f"an endpoint is http(s)://host[:port] without user or password "
                             f"(got {value!r})")
        return value
