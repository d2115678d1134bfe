"""Deduplicate documents and split them into train and validation, by document.

The split depends only on each document's content, never on its position or on the other
documents: a document goes to validation when ``int(sha256(text)) / 2**256 <
validation_fraction``. Adding a document therefore never moves an existing one, except through
the fallback below.

Fallback, so that neither split is empty (needs >= 2 documents): when validation is empty, the
document with the smallest hash (the one nearest the threshold from above) moves to validation;
when train is empty, the document with the largest hash (nearest the threshold from below) moves
to train.

:func:`deduplicate` and :func:`split_documents` are the rule on documents in memory; the data
step applies the same rule (:func:`in_validation`) while streaming (:mod:`trainforge.data.scan`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: Hash values are read as 256-bit integers and scaled to [0, 1).
_HASH_SPACE = 2**256


@dataclass(frozen=True)
class Document:
    """One cleaned document.

    Attributes:
        name: the source file's path relative to the sources' common base folder (POSIX).
        text: cleaned text.
        sha256: SHA-256 hex of ``text`` in UTF-8.
    """

    name: str
    text: str
    sha256: str

    @property
    def hash_fraction(self) -> float:
        """The document's position in [0, 1) used by the split rule."""
        return hash_fraction(bytes.fromhex(self.sha256))


def hash_fraction(sha256: bytes) -> float:
    """A document's position in [0, 1): its SHA-256 read as a big-endian 256-bit fraction."""
    return int.from_bytes(sha256, "big") / _HASH_SPACE


def in_validation(sha256: bytes, validation_fraction: float) -> bool:
    """The split rule of the module doc (before the fallback)."""
    return hash_fraction(sha256) < validation_fraction


def deduplicate(documents: Iterable[Document]) -> tuple[list[Document], int]:
    """Keep the first document of each distinct text (exact match by SHA-256), in order.

    Returns:
        (kept documents in the given order, number of duplicates removed)
    """
    seen: set[str] = set()
    kept: list[Document] = []
    removed = 0
    for doc in documents:
        if doc.sha256 in seen:
            removed += 1
            continue
        seen.add(doc.sha256)
        kept.append(doc)
    return kept, removed


def split_documents(documents: list[Document], validation_fraction: float
                    ) -> tuple[list[Document], list[Document]]:
    """Split distinct documents into (train, validation), each in the given order.

    Args:
        documents: distinct documents (see :func:`deduplicate`), at least 2.
        validation_fraction: in (0, 1).

    Raises:
        ValueError: fewer than 2 documents (the caller reports it as EmptyCorpusError).
    """
    if len(documents) < 2:
        raise ValueError(f"need at least 2 documents to split, got {len(documents)}")
    in_validation = {d.sha256: d.hash_fraction < validation_fraction for d in documents}
    if not any(in_validation.values()):
        in_validation[min(documents, key=lambda d: d.sha256).sha256] = True
    elif all(in_validation.values()):
        in_validation[max(documents, key=lambda d: d.sha256).sha256] = False
    train = [d for d in documents if not in_validation[d.sha256]]
    validation = [d for d in documents if in_validation[d.sha256]]
    return train, validation
