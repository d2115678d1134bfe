"""Parallel encoding: byte-identical output whatever the worker count; failures surface."""

from __future__ import annotations

import pytest
from tests.operators.data.conftest import jsonl_bytes, make_text

from trainforge.data import DataPrepError, prepare_dataset
from trainforge.data import prepare as prepare_mod
from trainforge.data.encode import encode_splits
from trainforge.data.spool import SpoolWriter


def all_bytes(result) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(result.path.iterdir())}


def test_one_or_several_workers_give_identical_bytes(tmp_path, make_settings, monkeypatch):
    folder = tmp_path / "c"
    folder.mkdir()
    texts = [make_text(i, 6) for i in range(150)]
    (folder / "a.jsonl").write_bytes(jsonl_bytes(texts[:90]))
    (folder / "b.jsonl").write_bytes(jsonl_bytes(texts[90:]))
    monkeypatch.setattr(prepare_mod, "chunk_bytes", lambda settings, source_bytes: 2000)  # ~40 ranges
    results = {}
    for workers in (1, 2, 3):
        results[workers] = prepare_dataset(
            make_settings(folder / "*", format="jsonl", encode_workers=workers, shard_tokens=3000),
            tmp_path / f"out-{workers}")
    one, two, three = results[1], results[2], results[3]
    assert one.digest == two.digest == three.digest
    assert len(one.manifest["splits"]["train"]["shards"]) > 2
    assert all_bytes(one) == all_bytes(two) == all_bytes(three)  # manifest included
    assert sum(one.documents.values()) == 150


def test_workers_do_not_change_the_digest_so_the_dataset_is_reused(tmp_path, make_settings,
                                                                   corpus):
    first = prepare_dataset(make_settings(corpus / "*.txt", encode_workers=1), tmp_path / "o")
    again = prepare_dataset(make_settings(corpus / "*.txt", encode_workers=2,
                                          memory_budget_mib=64), tmp_path / "o")
    assert again.reused and again.reuse == "local" and again.digest == first.digest


def test_a_failing_worker_stops_the_step_with_its_message(tmp_path):
    spool = SpoolWriter(tmp_path / "train.spool", 1000)
    spool.append(b"\0" * 32, "doc", b"some text")
    ranges = {"train": spool.close()}
    (tmp_path / "tokenizer.json").write_text("not a tokenizer")
    with pytest.raises(DataPrepError, match=r"encoding worker \d+ exited with code 1"):
        encode_splits(tmp_path / "tokenizer.json", ranges, folder=tmp_path, dtype="uint16",
                      shard_tokens=100, eos_id=0, workers=2)


def test_a_corpus_is_cut_into_enough_ranges_for_every_worker(tmp_path, make_settings):
    def chunk(workers: int, source_bytes: int, budget_mib: int = 1024) -> int:
        settings = make_settings(tmp_path / "*", encode_workers=workers,
                                 memory_budget_mib=budget_mib)
        return prepare_mod.chunk_bytes(settings, source_bytes)

    eight_mib = 8 << 20
    assert chunk(2, eight_mib) == eight_mib // (prepare_mod.RANGES_PER_WORKER * 2)
    assert chunk(1, eight_mib) == 2 * chunk(2, eight_mib)
    assert chunk(2, 10 << 30) == prepare_mod.MAX_CHUNK_BYTES  # a large corpus: the cap
    assert chunk(2, 10 << 30, budget_mib=16) == (16 << 20) // 16  # the memory budget
    assert chunk(4, 1000) == prepare_mod.MIN_CHUNK_BYTES  # a tiny corpus: no tiny ranges


def test_scanned_ranges_let_two_workers_share_the_encoding(tmp_path, make_settings, monkeypatch):
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(jsonl_bytes([make_text(i, 400) for i in range(60)]))
    seen = {}

    def spy(tokenizer_path, splits, **kwargs):
        seen.update({split: len(ranges) for split, ranges in splits.items()})
        return encode_splits(tokenizer_path, splits, **kwargs)

    monkeypatch.setattr(prepare_mod, "encode_splits", spy)
    prepare_dataset(make_settings(folder / "*", format="jsonl", encode_workers=2),
                    tmp_path / "out")
    assert seen["train"] >= 2 * 4  # several ranges per worker, not one for the whole split
