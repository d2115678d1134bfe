"""The ``data`` section of a pipeline spec: sources, cleaning, tokenizer, sequence length.

Relative paths resolve against ``TRAINFORGE_HOME`` (see :mod:`operators.paths`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from operators.spec.base import SpecModel


class CleaningSection(SpecModel):
    strip_gutenberg_boilerplate: bool = Field(
        False, description="Drop Project Gutenberg licence headers and footers."
    )
    normalize_whitespace: bool = Field(True, description="Collapse runs of blanks and blank lines.")
    unicode_normalization: Literal["NFC", "NFKC", "none"] = Field(
        "NFC", description="Unicode normal form applied to every line."
    )
    min_document_chars: int = Field(
        1, ge=1, description="Drop documents shorter than this many characters after cleaning."
    )


class TokenizerSection(SpecModel):
    vocab_size: int = Field(
        4096, ge=300, le=1_048_576, description="Byte-level BPE vocabulary size, trained on the "
        "train split. <= 65536 stores tokens as uint16, else uint32."
    )


class DataSection(SpecModel):
    sources: list[str] = Field(
        min_length=1,
        description="Local glob patterns of input files; relative paths resolve against "
        "TRAINFORGE_HOME.",
    )
    format: Literal["text"] = Field("text", description="Input format: one document per file.")
    cleaning: CleaningSection = CleaningSection()
    tokenizer: TokenizerSection = TokenizerSection()
    sequence_length: int = Field(256, ge=8, le=131_072, description="Tokens per training sequence.")
    validation_fraction: float = Field(
        0.1, gt=0.0, lt=0.5, description="Share of documents held out for validation."
    )
    shard_tokens: int = Field(
        16_777_216, ge=1024, description="Maximum tokens per shard file."
    )
    output_uri: str = Field(
        "datasets", description="Where prepared datasets go (one folder per dataset digest)."
    )
