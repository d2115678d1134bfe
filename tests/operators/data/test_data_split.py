"""Dedup and the by-document, content-hash split (pure unit tests)."""

from __future__ import annotations

import hashlib
import random

import pytest

from trainforge.data.split import Document, deduplicate, split_documents


def doc(text: str, name: str | None = None) -> Document:
    return Document(name or text, text, hashlib.sha256(text.encode()).hexdigest())


def fake(name: str, sha_prefix: str) -> Document:
    """A document whose hash is chosen by the test: ``sha_prefix`` padded to 64 hex digits."""
    return Document(name, name, sha_prefix.ljust(64, "0"))


def test_split_is_disjoint_complete_and_follows_the_hash_rule():
    docs = [doc(f"document number {i}") for i in range(300)]
    train, validation = split_documents(docs, 0.2)
    assert {d.sha256 for d in train}.isdisjoint({d.sha256 for d in validation})
    assert len(train) + len(validation) == len(docs)
    assert all(int(d.sha256, 16) / 2**256 < 0.2 for d in validation)
    assert all(int(d.sha256, 16) / 2**256 >= 0.2 for d in train)
    assert 30 < len(validation) < 90  # ~60 expected


def test_split_does_not_depend_on_order():
    docs = [doc(f"text {i}") for i in range(100)]
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    a = split_documents(docs, 0.3)
    b = split_documents(shuffled, 0.3)
    assert {d.name for d in a[1]} == {d.name for d in b[1]}
    assert [d.name for d in b[0]] == [d.name for d in shuffled if d in b[0]]  # keeps given order


def test_adding_documents_never_moves_old_ones():
    old = [doc(f"old {i}") for i in range(100)]
    new = [doc(f"new {i}") for i in range(50)]
    _, validation_before = split_documents(old, 0.25)
    _, validation_after = split_documents(new[:25] + old + new[25:], 0.25)
    before = {d.name for d in validation_before}
    after = {d.name for d in validation_after}
    assert after & {d.name for d in old} == before


def test_empty_validation_takes_the_smallest_hash():
    docs = [fake("a", "9"), fake("b", "5"), fake("c", "7")]  # all >= 0.1
    train, validation = split_documents(docs, 0.1)
    assert [d.name for d in validation] == ["b"]
    assert [d.name for d in train] == ["a", "c"]


def test_empty_train_takes_the_largest_hash():
    docs = [fake("a", "1"), fake("b", "3"), fake("c", "2")]  # all < 0.9
    train, validation = split_documents(docs, 0.9)
    assert [d.name for d in train] == ["b"]
    assert [d.name for d in validation] == ["a", "c"]


def test_split_needs_two_documents():
    with pytest.raises(ValueError, match="at least 2 documents"):
        split_documents([doc("alone")], 0.5)


def test_deduplicate_keeps_first_and_counts():
    docs = [doc("x", "1"), doc("y", "2"), doc("x", "3"), doc("x", "4")]
    kept, removed = deduplicate(docs)
    assert [d.name for d in kept] == ["1", "2"]
    assert removed == 2
