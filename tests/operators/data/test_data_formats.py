"""Every format and compression, malformed records (skip vs fail), document length bounds."""

from __future__ import annotations

import numpy as np
import pytest
from tests.operators.data.conftest import SUFFIX, compress, corpus_texts, jsonl_bytes, parquet_bytes

from trainforge.data import MalformedRecordError, SourceDecodeError, prepare_dataset


def shard_bytes(result) -> dict[str, bytes]:
    splits = result.manifest["splits"]
    return {split: b"".join((result.path / s["file"]).read_bytes() for s in splits[split]["shards"])
            for split in ("train", "validation")}


@pytest.fixture(scope="module")
def text_reference(tmp_path_factory):
    """The 12-document corpus prepared from plain text files: shards and tokenizer bytes."""
    from tests.operators.data.conftest import settings_for, write_corpus

    root = tmp_path_factory.mktemp("reference")
    write_corpus(root / "c")
    result = prepare_dataset(settings_for(root / "c" / "*.txt"), root / "o")
    return shard_bytes(result), (result.path / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
@pytest.mark.parametrize("fmt", ["text", "jsonl", "parquet"])
def test_every_format_and_compression_gives_the_same_tokens(
    tmp_path, make_settings, text_reference, fmt, compression
):
    """The same documents in the same order give byte-identical shards and tokenizer,
    whatever the container; only the digest (settings) and document names differ."""
    texts = corpus_texts()
    folder = tmp_path / "c"
    folder.mkdir()
    suffix = SUFFIX[compression]
    if fmt == "text":
        for i, text in enumerate(texts):
            data = compress(text.encode() + b"\n", compression)
            (folder / f"doc-{i:02d}.txt{suffix}").write_bytes(data)
    elif fmt == "jsonl":  # two files, so that order across files matters too
        (folder / f"a.jsonl{suffix}").write_bytes(compress(jsonl_bytes(texts[:5]), compression))
        (folder / f"b.jsonl{suffix}").write_bytes(compress(jsonl_bytes(texts[5:]), compression))
    else:
        (folder / f"a.parquet{suffix}").write_bytes(compress(parquet_bytes(texts), compression))
    result = prepare_dataset(make_settings(folder / "*", format=fmt), tmp_path / "o")
    shards, tokenizer = text_reference
    assert shard_bytes(result) == shards
    assert (result.path / "tokenizer.json").read_bytes() == tokenizer
    assert result.manifest["stats"]["documents_in"] == 12
    names = result.manifest["splits"]["train"]["document_names"]
    expected_name = {"text": "doc-", "jsonl": ".jsonl", "parquet": ".parquet"}[fmt]
    assert all(expected_name in n for n in names)
    if fmt == "parquet":
        assert any(n.endswith(":1:0") for n in result.manifest["splits"]["train"]["document_names"]
                   + result.manifest["splits"]["validation"]["document_names"])  # row group 1


def test_auto_format_mixes_formats_and_dedups_across_them(tmp_path, make_settings):
    texts = corpus_texts(8)
    folder = tmp_path / "c"
    folder.mkdir()
    for i, text in enumerate(texts[:4]):
        (folder / f"doc-{i}.txt").write_text(text + "\n")
    (folder / "more.jsonl.zst").write_bytes(compress(jsonl_bytes(texts[2:6]), "zstd"))  # 2 dups
    (folder / "rest.parquet").write_bytes(parquet_bytes(texts[5:] + [texts[0]]))  # 2 dups
    result = prepare_dataset(make_settings(folder / "*", format="auto"), tmp_path / "o")
    stats = result.manifest["stats"]
    assert stats["documents_in"] == 4 + 4 + 4
    assert stats["removed"]["duplicate"] == 4
    assert sum(result.documents.values()) == 8
    kept = result.manifest["splits"]["train"]["document_names"] + \
        result.manifest["splits"]["validation"]["document_names"]
    # first occurrence wins, in source-name order: doc-*.txt, then more.jsonl.zst, then rest
    assert sorted(kept) == sorted(["doc-0.txt", "doc-1.txt", "doc-2.txt", "doc-3.txt",
                                   "more.jsonl.zst:3", "more.jsonl.zst:4",
                                   "rest.parquet:0:1", "rest.parquet:0:2"])


def test_deduplicate_false_keeps_duplicates(tmp_path, make_settings):
    folder = tmp_path / "c"
    folder.mkdir()
    texts = corpus_texts(4)
    (folder / "a.jsonl").write_bytes(jsonl_bytes(texts + texts[:2]))
    on = prepare_dataset(make_settings(folder / "*", format="jsonl"), tmp_path / "o")
    off = prepare_dataset(make_settings(folder / "*", format="jsonl", deduplicate=False),
                          tmp_path / "o")
    assert on.manifest["stats"]["removed"]["duplicate"] == 2 and sum(on.documents.values()) == 4
    assert off.manifest["stats"]["removed"]["duplicate"] == 0 and sum(off.documents.values()) == 6


def write_bad_jsonl(folder):
    folder.mkdir()
    lines = [
        '{"text": "a good first document with enough words"}',
        "{not json",
        '["a list"]',
        '{"body": "no text field"}',
        '{"text": 42}',
        "",
        '{"text": "a good second document, also long enough"}',
        '{"text": "a good third document that is long enough"}',
    ]
    (folder / "bad.jsonl").write_text("\n".join(lines) + "\n")


def test_malformed_jsonl_skip_counts_and_names_file_and_line(tmp_path, make_settings):
    write_bad_jsonl(tmp_path / "c")
    result = prepare_dataset(
        make_settings(tmp_path / "c" / "*", format="jsonl", on_malformed="skip"), tmp_path / "o"
    )
    malformed = result.manifest["stats"]["malformed"]
    assert malformed["action"] == "skip" and malformed["count"] == 4
    examples = malformed["examples"]
    for line, fragment in ((2, "not JSON"), (3, "a JSON list, expected an object"),
                           (4, "no field 'text' (fields: body)"),
                           (5, "field 'text' is int, expected a string")):
        assert any(f"bad.jsonl: line {line}: {fragment}" in e for e in examples), examples
    assert result.manifest["stats"]["documents_in"] == 3
    assert result.summary()["malformed"] == 4


@pytest.mark.parametrize(
    ("write", "fmt", "fragment"),
    [
        (write_bad_jsonl, "jsonl", r"bad\.jsonl' at line 2: not JSON"),
        (lambda f: (f.mkdir(), (f / "x.txt").write_bytes(b"fine\nna\xefve\n")), "text",
         r"x\.txt' is not UTF-8: .* at line 2, byte offset 7"),
        (lambda f: (f.mkdir(), (f / "p.parquet").write_bytes(parquet_bytes(["ok"] * 5 + [None]))),
         "parquet", r"p\.parquet' at row group 1, row 1: null in text column 'text'"),
        (lambda f: (f.mkdir(), (f / "p.parquet").write_bytes(parquet_bytes(["ok"], column="body"))),
         "parquet", r"p\.parquet' at file: no column 'text' \(columns: id, body\)"),
        (lambda f: (f.mkdir(), (f / "n.parquet").write_bytes(b"PAR1 not really")), "parquet",
         r"n\.parquet' at file: not Parquet"),
        (lambda f: (f.mkdir(), (f / "t.txt.gz").write_bytes(compress(b"x" * 5000, "gzip")[:-30])),
         "text", r"t\.txt\.gz' at compressed byte \d+: cannot decompress"),
    ],
)
def test_malformed_fail_names_the_record(tmp_path, make_settings, write, fmt, fragment):
    write(tmp_path / "c")
    with pytest.raises(MalformedRecordError, match=fragment):
        prepare_dataset(make_settings(tmp_path / "c" / "*", format=fmt), tmp_path / "o")
    assert not any((tmp_path / "o").iterdir())  # nothing half-written stays


def test_text_decode_error_is_a_malformed_record(tmp_path, make_settings, corpus_writer):
    corpus_writer(tmp_path / "c", count=4)
    (tmp_path / "c" / "latin1.txt").write_bytes(b"ok line\nna\xefve\n")
    with pytest.raises(SourceDecodeError):
        prepare_dataset(make_settings(tmp_path / "c" / "*.txt"), tmp_path / "o")
    skipped = prepare_dataset(make_settings(tmp_path / "c" / "*.txt", on_malformed="skip"),
                              tmp_path / "o")
    assert skipped.manifest["stats"]["malformed"]["count"] == 1
    assert "latin1.txt: line 2, byte offset 10: not UTF-8" in \
        skipped.manifest["stats"]["malformed"]["examples"][0]
    assert sum(skipped.documents.values()) == 4


def test_min_and_max_document_length(tmp_path, make_settings):
    folder = tmp_path / "c"
    folder.mkdir()
    texts = ["short", "x" * 50, "y " * 40, "z" * 101, "w" * 100 + "\n" + "v" * 10]
    (folder / "a.jsonl").write_bytes(jsonl_bytes(texts))
    # one line over the reader's line limit (4 bytes x max + 1 MiB): skipped without parsing
    (folder / "b.jsonl").write_text('{"text": "' + "q" * (1 << 20) + '"}\n')
    result = prepare_dataset(
        make_settings(folder / "*", format="jsonl", min_document_chars=10, max_document_chars=100),
        tmp_path / "o",
    )
    assert result.manifest["stats"]["removed"] == {"empty": 0, "too_short": 1, "too_long": 3,
                                                   "duplicate": 0}
    assert sum(result.documents.values()) == 2


def test_text_document_longer_than_max_is_dropped_while_streaming(tmp_path, make_settings,
                                                                   corpus_writer):
    corpus_writer(tmp_path / "c", count=3, lines=10)
    (tmp_path / "c" / "huge.txt").write_text("word " * 2000 + "\n" + "line\n" * 3000)
    result = prepare_dataset(make_settings(tmp_path / "c" / "*.txt", max_document_chars=5000),
                             tmp_path / "o")
    assert result.manifest["stats"]["removed"]["too_long"] == 1
    assert "huge.txt" not in str(result.manifest["splits"])


def test_uint16_ids_and_eos_between_documents(tmp_path, make_settings, corpus):
    result = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "o")
    entry = result.manifest["splits"]["train"]
    ids = np.fromfile(result.path / entry["shards"][0]["file"], dtype="<u2")
    assert int((ids == 0).sum()) == entry["documents"] and ids[-1] == 0
    index = (result.path / entry["index"]["file"]).read_text().splitlines()
    assert len(index) == entry["documents"]
    assert sum(int(line.split("\t")[1]) for line in index) == entry["tokens"]
