"""Fixtures of the data-preparation tests: small corpora written into tmp_path."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from operators.data import PrepareSettings

_WORDS = (
    "thou art the king of verona and thy love is fair as summer night but "
    "what light through yonder window breaks it is the east and juliet the sun "
    "romeo wherefore sword crown ghost witch storm island duke fool lady lord"
).split()


def make_text(seed: int, lines: int = 60) -> str:
    """Deterministic pseudo-verse: ``lines`` lines of 4-9 words, a blank line every 5 lines."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 9))).capitalize())
        if i % 5 == 4:
            out.append("")
    return "\n".join(out)


def write_corpus(folder: Path, count: int = 12, lines: int = 60) -> list[Path]:
    """Write ``count`` documents ``doc-00.txt`` ... into ``folder``; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"doc-{i:02d}.txt"
        path.write_text(make_text(i, lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def settings_for(pattern: str | Path, **overrides: Any) -> PrepareSettings:
    values: dict[str, Any] = dict(
        sources=[str(pattern)],
        strip_gutenberg_boilerplate=True,
        normalize_whitespace=True,
        unicode_normalization="NFC",
        min_document_chars=10,
        vocab_size=300,
        validation_fraction=0.25,
        shard_tokens=100_000,
    )
    values.update(overrides)
    return PrepareSettings(**values)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of 12 small documents; use ``corpus / "*.txt"`` as the source pattern."""
    folder = tmp_path / "corpus"
    write_corpus(folder)
    return folder


@pytest.fixture
def make_settings():
    """``make_settings(pattern, **overrides) -> PrepareSettings`` with small-corpus defaults."""
    return settings_for


@pytest.fixture
def corpus_writer():
    """``corpus_writer(folder, count=12, lines=60) -> [paths]``."""
    return write_corpus
