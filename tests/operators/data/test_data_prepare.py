"""prepare_dataset end to end on small corpora written by the tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from trainforge.data import (
    DatasetInvalidError,
    EmptyCorpusError,
    SourceDecodeError,
    SourceNotFoundError,
    load_manifest,
    prepare_dataset,
    verify_dataset,
)

CONTRACT_KEYS = {
    "format",
    "digest",
    "dtype",
    "vocab_size",
    "eos_token",
    "eos_id",
    "tokenizer",
    "splits",
    "sources",
    "settings",
    "stats",
}


def read_split(dataset: Path, manifest: dict, split: str) -> np.ndarray:
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    return np.concatenate(
        [np.fromfile(dataset / s["file"], dtype=dtype) for s in manifest["splits"][split]["shards"]]
    )


def documents_of(ids: np.ndarray, eos_id: int = 0) -> list[np.ndarray]:
    ends = np.flatnonzero(ids == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ids[s:e] for s, e in zip(starts, ends)]


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if p.suffix in (".bin", ".json") and p.name != "manifest.json"
    }


def test_dataset_matches_the_contract(corpus, tmp_path, make_settings):
    result = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "datasets")
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert CONTRACT_KEYS <= manifest.keys()
    assert result.path == tmp_path / "datasets" / manifest["digest"]
    assert (manifest["format"], manifest["dtype"], manifest["eos_token"], manifest["eos_id"]) == (
        "trainforge.dataset/v1",
        "uint16",
        "<|endoftext|>",
        0,
    )
    assert manifest["vocab_size"] == 300
    assert not result.reused
    assert verify_dataset(result.path) == []
    assert load_manifest(result.path) == manifest == result.manifest
    assert manifest["stats"]["documents_in"] == 12
    assert result.documents["train"] + result.documents["validation"] == 12
    assert min(result.documents.values()) >= 1
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == [manifest["digest"]]
    summary = result.summary()
    assert summary["tokens"] == result.tokens and json.dumps(summary)


def test_shards_decode_back_to_the_cleaned_documents(corpus, tmp_path, make_settings):
    result = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "out")
    manifest = result.manifest
    tokenizer = Tokenizer.from_file(str(result.path / "tokenizer.json"))
    names_seen = []
    for split in ("train", "validation"):
        entry = manifest["splits"][split]
        ids = read_split(result.path, manifest, split)
        assert ids.size == entry["tokens"] and ids[-1] == 0
        docs = documents_of(ids)
        assert len(docs) == entry["documents"] == len(entry["document_names"])
        texts = [tokenizer.decode(d.tolist()) for d in docs]
        expected = [(corpus / n).read_text().strip("\n") for n in entry["document_names"]]
        assert texts == expected
        assert entry["bytes_utf8"] == sum(len(t.encode()) for t in texts)
        names_seen += entry["document_names"]
    assert sorted(names_seen) == sorted(p.name for p in corpus.iterdir())  # each in one split


def test_shards_hold_at_most_shard_tokens(corpus, tmp_path, make_settings):
    small = prepare_dataset(make_settings(corpus / "*.txt", shard_tokens=500), tmp_path / "a")
    big = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "b")
    for split in ("train", "validation"):
        shards = small.manifest["splits"][split]["shards"]
        assert len(shards) > 1
        assert all(s["tokens"] == 500 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 500
        assert [s["file"] for s in shards] == [f"{split}-{i:05d}.bin" for i in range(len(shards))]
        assert np.array_equal(
            read_split(small.path, small.manifest, split), read_split(big.path, big.manifest, split)
        )
    assert small.digest != big.digest


def test_uint32_shards_above_65536_tokens(corpus, tmp_path, make_settings):
    result = prepare_dataset(make_settings(corpus / "*.txt", vocab_size=70_000), tmp_path / "o")
    assert result.manifest["dtype"] == "uint32"
    shard = result.manifest["splits"]["train"]["shards"][0]
    assert shard["bytes"] == 4 * shard["tokens"]
    assert result.manifest["tokenizer"]["trained_vocab_size"] < 70_000  # tiny corpus
    assert verify_dataset(result.path) == []


def test_same_inputs_elsewhere_give_identical_bytes(corpus, tmp_path, make_settings):
    first = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "one")
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(corpus, moved)
    second = prepare_dataset(make_settings(moved / "*.txt"), tmp_path / "two")
    assert second.digest == first.digest
    assert file_bytes(second.path) == file_bytes(first.path)
    assert second.manifest["splits"] == first.manifest["splits"]


def test_changing_a_setting_or_a_source_changes_the_digest(corpus, tmp_path, make_settings):
    base = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "o").digest
    other = prepare_dataset(
        make_settings(corpus / "*.txt", min_document_chars=11), tmp_path / "o"
    ).digest
    (corpus / "doc-00.txt").write_text("changed text of the first document\n")
    changed = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "o").digest
    assert len({base, other, changed}) == 3


def test_second_call_reuses_without_rewriting(corpus, tmp_path, make_settings):
    first = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "o")
    stamps = {p.name: p.stat().st_mtime_ns for p in first.path.iterdir()}
    again = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "o")
    assert again.reused and again.digest == first.digest
    assert {p.name: p.stat().st_mtime_ns for p in again.path.iterdir()} == stamps
    assert again.summary()["documents"] == first.summary()["documents"]


def test_a_dataset_that_no_longer_verifies_is_rebuilt(corpus, tmp_path, make_settings):
    first = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "o")
    shard = first.path / "train-00000.bin"
    good = shard.read_bytes()
    shard.write_bytes(b"\x01\x00" + good[2:])
    assert any("train-00000.bin" in p and "sha256" in p for p in verify_dataset(first.path))
    again = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "o")
    assert not again.reused
    assert shard.read_bytes() == good
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [first.digest]


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
        (lambda d: (d / "validation-00000.bin").unlink(), "validation-00000.bin: cannot read"),
        (lambda d: (d / "tokenizer.json").write_text("{}"), "tokenizer.json"),
        (lambda d: (d / "train-00000.bin").open("ab").write(b"\0\0"), "bytes, manifest says"),
        (
            lambda d: (d / "manifest.json").write_text('{"format": "other/v9"}'),
            "format is 'other/v9'",
        ),
        (lambda d: (d / "manifest.json").write_text("{not json"), "unreadable manifest.json"),
    ],
)
def test_verify_names_the_problem(corpus, tmp_path, make_settings, damage, fragment):
    result = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "o")
    damage(result.path)
    problems = verify_dataset(result.path)
    assert any(fragment in p for p in problems), problems


def test_verify_checks_id_range_and_final_eos(corpus, tmp_path, make_settings):
    result = prepare_dataset(make_settings(corpus / "*.txt"), tmp_path / "o")
    manifest = dict(result.manifest, vocab_size=10)
    (result.path / "manifest.json").write_text(json.dumps(manifest))
    assert any(">= vocab_size 10" in p for p in verify_dataset(result.path))


def test_load_manifest_raises_for_a_missing_dataset(tmp_path):
    with pytest.raises(DatasetInvalidError, match="no manifest.json"):
        load_manifest(tmp_path)


def test_cleaning_dedup_and_short_documents_are_counted(tmp_path, make_settings, corpus_writer):
    folder = tmp_path / "c"
    corpus_writer(folder, count=4)
    (folder / "dup.txt").write_text((folder / "doc-01.txt").read_text() + "\n\n\n")
    (folder / "blank.txt").write_text("   \n\t\n")
    (folder / "short.txt").write_text("tiny\n")
    (folder / "gut.txt").write_text(
        "Header\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\n"
        + (folder / "doc-02.txt").read_text()
        + "extra line\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nLicence\n"
    )
    result = prepare_dataset(make_settings(folder / "*.txt"), tmp_path / "o")
    stats = result.manifest["stats"]
    assert stats["documents_in"] == 8
    assert stats["removed"] == {"empty": 1, "too_short": 1, "too_long": 0, "duplicate": 1}
    assert stats["cleaning"]["gutenberg_header_lines"] == 2
    assert stats["cleaning"]["gutenberg_footer_lines"] == 2
    assert sum(result.documents.values()) == 5


def test_sources_from_several_patterns_and_folders(tmp_path, make_settings, corpus_writer):
    corpus_writer(tmp_path / "src" / "a", count=3)
    corpus_writer(tmp_path / "src" / "b" / "deep", count=3)
    settings = make_settings(
        tmp_path / "src" / "a" / "*.txt",
        sources=[
            str(tmp_path / "src/a/*.txt"),
            str(tmp_path / "src/b/**/*.txt"),
            str(tmp_path / "src/a/doc-00.txt"),
        ],
    )
    result = prepare_dataset(settings, tmp_path / "o")
    names = [s["name"] for s in result.manifest["sources"]]
    assert names == [
        "a/doc-00.txt",
        "a/doc-01.txt",
        "a/doc-02.txt",
        "b/deep/doc-00.txt",
        "b/deep/doc-01.txt",
        "b/deep/doc-02.txt",
    ]
    # b/deep/doc-0N has the same text as a/doc-0N: dedup keeps the a/ copies
    assert result.manifest["stats"]["removed"]["duplicate"] == 3


def test_errors_name_the_pattern_or_file(tmp_path, make_settings, corpus_writer):
    corpus_writer(tmp_path / "c", count=3)
    with pytest.raises(
        SourceNotFoundError, match=r"no files match source pattern '.*nothing-\*\.txt'"
    ):
        prepare_dataset(
            make_settings(
                tmp_path / "c" / "*.txt",
                sources=[str(tmp_path / "c" / "*.txt"), str(tmp_path / "nothing-*.txt")],
            ),
            tmp_path / "o",
        )
    (tmp_path / "c" / "latin1.txt").write_bytes(b"ok line\nna\xefve\n")
    with pytest.raises(SourceDecodeError, match=r"latin1\.txt' is not UTF-8: .* byte offset 10"):
        prepare_dataset(make_settings(tmp_path / "c" / "*.txt"), tmp_path / "o")
    assert not any((tmp_path / "o").iterdir())  # the temporary folder is gone


def test_corpus_empty_after_cleaning(tmp_path, make_settings):
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.txt").write_text("\n\n   \n")
    (folder / "b.txt").write_text("short\n")
    (folder / "c.txt").write_text("this one is long enough to keep\n")
    with pytest.raises(
        EmptyCorpusError,
        match=r"1 document\(s\) left of 3 read \(removed: "
        r"duplicate=0, empty=1, too_long=0, too_short=1\)",
    ):
        prepare_dataset(make_settings(folder / "*.txt"), tmp_path / "o")
    assert list((tmp_path / "o").iterdir()) == []


def test_adding_a_document_keeps_old_documents_in_their_split(
    tmp_path, make_settings, corpus_writer
):
    folder = tmp_path / "c"
    corpus_writer(folder, count=12)
    before = prepare_dataset(make_settings(folder / "*.txt"), tmp_path / "o").manifest["splits"]
    corpus_writer(tmp_path / "more", count=20)
    for i in range(12, 20):  # 8 new, different documents
        (folder / f"new-{i}.txt").write_text((tmp_path / "more" / f"doc-{i:02d}.txt").read_text())
    after = prepare_dataset(make_settings(folder / "*.txt"), tmp_path / "o").manifest["splits"]
    for split in ("train", "validation"):
        old_after = [n for n in after[split]["document_names"] if n.startswith("doc-")]
        assert old_after == before[split]["document_names"]
    assert set(after["train"]["document_names"]).isdisjoint(after["validation"]["document_names"])
