"""Reusing an existing tokenizer (local path here; S3 in test_data_s3.py, a registered model in
tests/operators/tasks/test_prepare_data.py)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from trainforge.data import TokenizerSourceError, prepare_dataset


@pytest.fixture
def trained(corpus, tmp_path, make_settings):
    """A dataset whose tokenizer the tests reuse."""
    return prepare_dataset(make_settings(corpus / "*.txt", vocab_size=320), tmp_path / "first")


def test_reused_tokenizer_is_kept_byte_for_byte(trained, tmp_path, make_settings,
                                                corpus_writer):
    corpus_writer(tmp_path / "new", count=6, lines=30)  # a different corpus, same vocabulary
    tokenizer_file = trained.path / "tokenizer.json"
    result = prepare_dataset(
        make_settings(tmp_path / "new" / "*.txt", vocab_size=320,
                      tokenizer_uri=str(tokenizer_file)), tmp_path / "second")
    assert (result.path / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    assert result.manifest["tokenizer"]["source"] == str(tokenizer_file)
    assert result.manifest["tokenizer"]["sha256"] == trained.manifest["tokenizer"]["sha256"]
    assert result.manifest["vocab_size"] == 320 and result.manifest["eos_id"] == 0


def test_the_tokenizer_content_is_in_the_digest(trained, tmp_path, make_settings, corpus):
    copy = tmp_path / "tok.json"
    copy.write_bytes((trained.path / "tokenizer.json").read_bytes())
    reused = prepare_dataset(make_settings(corpus / "*.txt", vocab_size=320,
                                           tokenizer_uri=str(copy)), tmp_path / "o")
    assert reused.digest != trained.digest  # reusing is not training
    moved = tmp_path / "elsewhere.json"
    copy.rename(moved)
    again = prepare_dataset(make_settings(corpus / "*.txt", vocab_size=320,
                                          tokenizer_uri=str(moved)), tmp_path / "o")
    assert again.reused and again.digest == reused.digest  # the URI is not, the content is
    data = json.loads(moved.read_text())
    data["model"]["vocab"]["extra-token"] = len(data["model"]["vocab"])
    moved.write_text(json.dumps(data))
    changed = prepare_dataset(make_settings(corpus / "*.txt", vocab_size=400,
                                            tokenizer_uri=str(moved)), tmp_path / "o")
    assert changed.digest != reused.digest


@pytest.mark.parametrize(
    ("mutate", "vocab_size", "fragment"),
    [
        (lambda t: t, 300, "it has 320 tokens but data.tokenizer.vocab_size is 300"),
        (lambda t: "{not json", 320, "not a tokenizers JSON file"),
        (lambda t: _without_eos(t), 320, "no EOS token '<|endoftext|>'"),
    ],
)
def test_unusable_tokenizers_are_refused(trained, tmp_path, make_settings, corpus, mutate,
                                         vocab_size, fragment):
    bad = tmp_path / "bad.json"
    bad.write_text(mutate((trained.path / "tokenizer.json").read_text()))
    with pytest.raises(TokenizerSourceError, match="cannot be reused") as info:
        prepare_dataset(make_settings(corpus / "*.txt", vocab_size=vocab_size,
                                      tokenizer_uri=str(bad)), tmp_path / "o")
    assert fragment in str(info.value) and str(bad) in str(info.value)


def _without_eos(text: str) -> str:
    tokenizer = Tokenizer.from_str(text)
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = []
    data["model"]["vocab"] = {k: v for k, v in data["model"]["vocab"].items()
                              if k != "<|endoftext|>"}
    return json.dumps(data)
