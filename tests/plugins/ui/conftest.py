"""Fixtures of the UI tests: the demo corpus for the browser test's pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import data_cache


@pytest.fixture(scope="session")
def shakespeare_corpus(request) -> Path:
    """The real demo corpus, fetched once into pytest's cache folder (like `make demo` does)."""
    from trainforge.data.corpus import fetch_corpus

    dest = data_cache(request.config) / "shakespeare"
    return Path(fetch_corpus(dest, timeout_s=300).dest)
