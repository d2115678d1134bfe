"""Settings of one dataset preparation: everything that changes the output.

The pipeline spec (``operators.spec``) owns the user-facing defaults; this dataclass has none for
tunable values (STYLE habit 1), only the EOS token fixed by ``docs/contracts.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from operators.data.errors import InvalidSettingsError

#: End-of-document token; id 0 in every tokenizer (docs/contracts.md, "Dataset").
EOS_TOKEN = "<|endoftext|>"

#: Byte-level BPE starts from the 256 byte symbols; the special tokens come on top.
BYTE_ALPHABET_SIZE = 256

#: Largest id that fits the uint32 shard dtype (2**32 ids).
MAX_VOCAB_SIZE = 2**32

UnicodeNormalization = Literal["NFC", "NFKC", "none"]


@dataclass(frozen=True, kw_only=True)
class PrepareSettings:
    """How to turn source files into a tokenized dataset.

    Attributes:
        sources: glob patterns of local UTF-8 text files, one document per file; absolute or
            relative to the current directory; ``**`` recurses. Matching files are identified in
            the digest by their path relative to the patterns' common base folder, so the same
            corpus in another folder gives the same dataset.
        strip_gutenberg_boilerplate: drop Project Gutenberg licence headers, footers and the
            ``<<THIS ELECTRONIC VERSION ...>>`` notices (see ``operators.data.clean``).
        normalize_whitespace: collapse runs of horizontal whitespace to one space, strip
            trailing whitespace, collapse runs of blank lines to one blank line, trim blank lines
            at both ends.
        unicode_normalization: Unicode normal form applied to every line (``"none"`` to skip).
        min_document_chars: documents shorter than this (characters, after cleaning) are dropped.
        vocab_size: BPE vocabulary size including the EOS token (>= 257); also the model's
            embedding size. Shards are uint16 when ``vocab_size <= 65536``, else uint32.
        validation_fraction: expected share of documents in the validation split, in (0, 1).
        shard_tokens: maximum tokens per shard file.
        eos_token: end-of-document token, id 0, written after every document.
    """

    sources: tuple[str, ...]
    strip_gutenberg_boilerplate: bool
    normalize_whitespace: bool
    unicode_normalization: UnicodeNormalization
    min_document_chars: int
    vocab_size: int
    validation_fraction: float
    shard_tokens: int
    eos_token: str = field(default=EOS_TOKEN)

    def __post_init__(self) -> None:
        if isinstance(self.sources, str) or not all(isinstance(s, str) for s in self.sources):
            raise InvalidSettingsError("sources", self.sources, "a list of glob pattern strings")
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.sources or any(not s.strip() for s in self.sources):
            raise InvalidSettingsError("sources", self.sources, "at least one non-empty pattern")
        for name in ("strip_gutenberg_boilerplate", "normalize_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSettingsError(name, getattr(self, name), "true or false")
        if self.unicode_normalization not in ("NFC", "NFKC", "none"):
            raise InvalidSettingsError(
                "unicode_normalization", self.unicode_normalization, "'NFC', 'NFKC' or 'none'"
            )
        _check_int("min_document_chars", self.min_document_chars, 1)
        _check_int("shard_tokens", self.shard_tokens, 1)
        if not isinstance(self.eos_token, str) or not self.eos_token:
            raise InvalidSettingsError("eos_token", self.eos_token, "a non-empty string")
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

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Special tokens in id order; the EOS token is id 0."""
        return (self.eos_token,)

    @property
    def dtype(self) -> str:
        """Shard dtype name: ``uint16`` when every id fits in 16 bits, else ``uint32``."""
        return "uint16" if self.vocab_size <= 2**16 else "uint32"

    def output_settings(self) -> dict[str, Any]:
        """The settings that enter the digest and the manifest: all but the source patterns
        (the matched files themselves, by relative name and SHA-256, stand for those)."""
        values = asdict(self)
        del values["sources"]
        return values


def _check_int(name: str, value: object, low: int, high: int | None = None, why: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value <= high  # type: ignore[operator]
    if not ok:
        expected = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        raise InvalidSettingsError(name, value, f"{expected} {why}".strip())
