"""Split and dedup properties of the whole pipeline, on random corpora (several seeds).

Each property is checked on what prepare_dataset wrote (the per-split document indexes), so a
broken rule anywhere in the streaming scan (split by hash, fallback, dedup) fails here.
"""

from __future__ import annotations

import hashlib
import random

import pytest
from tests.operators.data.conftest import jsonl_bytes, make_text

from trainforge.data import prepare_dataset


def index_of(result, split: str) -> list[tuple[str, str]]:
    """(sha256, name) of each document of ``split``, in shard order."""
    entry = result.manifest["splits"][split]
    lines = (result.path / entry["index"]["file"]).read_text().splitlines()
    return [(line.split("\t")[0], line.split("\t")[2]) for line in lines]


def random_corpus(rng: random.Random, count: int) -> list[str]:
    """Texts that cleaning leaves as they are (so their hashes are the documents' hashes)."""
    return [make_text(rng.randrange(10**9), lines=rng.randint(3, 12)).strip("\n")
            for _ in range(count)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_leakage_and_the_hash_rule(tmp_path, make_settings, seed):
    rng = random.Random(seed)
    texts = random_corpus(rng, 60)
    texts += [rng.choice(texts) for _ in range(15)]  # exact duplicates, some across files
    rng.shuffle(texts)
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(jsonl_bytes(texts[:40]))
    (folder / "b.jsonl").write_bytes(jsonl_bytes(texts[40:]))
    fraction = rng.choice([0.1, 0.25, 0.4])
    result = prepare_dataset(make_settings(folder / "*", format="jsonl",
                                           validation_fraction=fraction), tmp_path / "o")
    train, validation = index_of(result, "train"), index_of(result, "validation")
    train_hashes = {h for h, _ in train}
    validation_hashes = {h for h, _ in validation}
    distinct = {hashlib.sha256(t.encode()).hexdigest() for t in texts}
    # no leakage: each distinct text is in exactly one split, exactly once
    assert train_hashes.isdisjoint(validation_hashes)
    assert len(train) == len(train_hashes) and len(validation) == len(validation_hashes)
    assert train_hashes | validation_hashes == distinct
    assert result.manifest["stats"]["removed"]["duplicate"] == len(texts) - len(distinct)
    # the hash rule (no fallback needed at this size)
    assert all(int(h, 16) / 2**256 < fraction for h in validation_hashes)
    assert all(int(h, 16) / 2**256 >= fraction for h in train_hashes)
    # the first occurrence is the one kept: corpus order is a.jsonl, then b.jsonl, by line
    first = {}
    for i, text in enumerate(texts):
        name = f"a.jsonl:{i + 1}" if i < 40 else f"b.jsonl:{i - 39}"
        first.setdefault(hashlib.sha256(text.encode()).hexdigest(), name)
    assert dict(train + validation) == first


@pytest.mark.parametrize("seed", [4, 5])
def test_adding_documents_never_moves_old_ones(tmp_path, make_settings, seed):
    rng = random.Random(seed)
    old, new = random_corpus(rng, 40), random_corpus(rng, 30)
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(jsonl_bytes(old))
    before = prepare_dataset(make_settings(folder / "*", format="jsonl"), tmp_path / "o")
    (folder / "0-new.jsonl").write_bytes(jsonl_bytes(new[:15]))  # sorts before a.jsonl
    (folder / "z-new.jsonl").write_bytes(jsonl_bytes(new[15:] + old[:5]))  # with 5 duplicates
    after = prepare_dataset(make_settings(folder / "*", format="jsonl"), tmp_path / "o")
    assert after.digest != before.digest
    for split in ("train", "validation"):
        old_before = index_of(before, split)
        old_after = [(h, n) for h, n in index_of(after, split) if n.startswith("a.jsonl")]
        assert old_after == old_before  # same documents, same split, same relative order
    assert after.manifest["stats"]["removed"]["duplicate"] == 5


def test_fallback_fills_an_empty_validation_split(tmp_path, make_settings):
    texts = [make_text(i, 8).strip("\n") for i in range(6)]
    # the lowest-hash text is the one the fallback must move to validation
    hashes = sorted((hashlib.sha256(t.encode()).hexdigest(), t) for t in texts)
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(jsonl_bytes(texts))
    fraction = int(hashes[0][0], 16) / 2**256 * 0.5  # below every document's hash
    result = prepare_dataset(make_settings(folder / "*", format="jsonl",
                                           validation_fraction=fraction), tmp_path / "o")
    assert [h for h, _ in index_of(result, "validation")] == [hashes[0][0]]
    assert len(index_of(result, "train")) == 5
    assert hashes[0][0] not in {h for h, _ in index_of(result, "train")}


def test_fallback_fills_an_empty_train_split(tmp_path, make_settings):
    texts = [make_text(i, 8).strip("\n") for i in range(6)]
    hashes = sorted(hashlib.sha256(t.encode()).hexdigest() for t in texts)
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(jsonl_bytes(texts))
    fraction = min(0.999, (int(hashes[-1], 16) / 2**256 + 1) / 2)  # above every hash
    result = prepare_dataset(make_settings(folder / "*", format="jsonl",
                                           validation_fraction=fraction), tmp_path / "o")
    assert [h for h, _ in index_of(result, "train")] == [hashes[-1]]
    assert len(index_of(result, "validation")) == 5
