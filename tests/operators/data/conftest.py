"""Fixtures of the data-preparation tests: small corpora written into tmp_path."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from trainforge.data import PrepareSettings

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


# -- multi-format and S3 helpers ------------------------------------------------------------


def compress(data: bytes, kind: str) -> bytes:
    """``data`` as stored with ``kind`` compression: ``none``, ``gzip`` or ``zstd``."""
    if kind == "gzip":
        import gzip

        return gzip.compress(data, mtime=0)
    if kind == "zstd":
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    return data


SUFFIX = {"none": "", "gzip": ".gz", "zstd": ".zst"}


def jsonl_bytes(texts: list[str], field: str = "text") -> bytes:
    import json

    return "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)).encode()


def parquet_bytes(texts: list, column: str = "text", row_group_size: int = 4) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    table = pa.table({"id": list(range(len(texts))), column: pa.array(texts, pa.string())})
    pq.write_table(table, buf, row_group_size=row_group_size)
    return buf.getvalue()


def corpus_texts(count: int = 12, lines: int = 60) -> list[str]:
    """The texts ``write_corpus`` writes, without the trailing newline (cleaned form)."""
    return [make_text(i, lines) for i in range(count)]


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Credentials and region for the loopback S3 server; yields a boto3 client of it."""
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return boto3.client("s3", endpoint_url=s3_server)


@pytest.fixture
def bucket(s3_env, request) -> str:
    """A fresh bucket on the loopback S3 server, named after the test."""
    import re

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"tf-{name}-{random.randrange(16**6):06x}"
    s3_env.create_bucket(Bucket=name)
    return name
