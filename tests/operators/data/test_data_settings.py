"""PrepareSettings: validation of every field (pure unit tests)."""

from __future__ import annotations

import pytest

from trainforge.data import EOS_TOKEN, InvalidSettingsError


def test_valid_settings_normalise_types(make_settings):
    settings = make_settings("/data/*.txt", validation_fraction=1 / 8)
    assert settings.sources == ("/data/*.txt",)
    assert settings.eos_token == EOS_TOKEN == "<|endoftext|>"
    assert settings.special_tokens == (EOS_TOKEN,)
    assert "sources" not in settings.output_settings()
    assert settings.output_settings()["vocab_size"] == 300


@pytest.mark.parametrize(
    ("vocab_size", "dtype"), [(257, "uint16"), (65536, "uint16"), (65537, "uint32")]
)
def test_dtype_follows_vocab_size(make_settings, vocab_size, dtype):
    assert make_settings("x", vocab_size=vocab_size).dtype == dtype


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("vocab_size", 256, "vocab_size=256: expected an integer >= 257"),
        ("vocab_size", 4096.0, "vocab_size=4096.0"),
        ("vocab_size", 2**32 + 1, "<= 4294967296"),
        ("validation_fraction", 0.0, "strictly between 0 and 1"),
        ("validation_fraction", 1.0, "strictly between 0 and 1"),
        ("validation_fraction", float("nan"), "strictly between 0 and 1"),
        ("validation_fraction", True, "strictly between 0 and 1"),
        ("min_document_chars", 0, "min_document_chars=0: expected an integer >= 1"),
        ("shard_tokens", 0, "shard_tokens=0"),
        ("sources", [], "at least one non-empty pattern"),
        ("sources", "/data/*.txt", "a list of glob pattern strings"),
        ("sources", [""], "at least one non-empty pattern"),
        ("unicode_normalization", "NFD", "'NFC', 'NFKC' or 'none'"),
        ("normalize_whitespace", "yes", "true or false"),
        ("eos_token", "", "non-empty string"),
    ],
)
def test_invalid_settings(make_settings, field, value, fragment):
    with pytest.raises(InvalidSettingsError, match=None) as info:
        make_settings("x", **{field: value})
    assert info.value.field == field
    assert fragment in str(info.value)


def test_settings_are_frozen(make_settings):
    settings = make_settings("x")
    with pytest.raises(AttributeError):
        settings.vocab_size = 512  # type: ignore[misc]
