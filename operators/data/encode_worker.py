"""The encoding worker process of :mod:`trainforge.data.encode`.

``python -m trainforge.data.encode_worker TOKENIZER DTYPE EOS_ID`` loads the tokenizer once,
then answers each pickled :class:`~trainforge.data.spool.Range` on stdin with
``("ok", EncodedRange)`` or ``("error", traceback)`` on stdout, in the order asked, until EOF.
It imports only the standard library, ``tokenizers`` and the spool reader (no numpy), so that a
worker starts in a fraction of the time a range takes to encode; its token ids travel as the
little-endian bytes of the shard's ``dtype``.
"""

from __future__ import annotations

import array
import itertools
import pickle
import sys
import traceback
from dataclasses import dataclass
from typing import Any, BinaryIO

from trainforge.data.spool import Range, read_range

#: Text per ``encode_batch`` call inside a worker (bytes): bounds the tokenizer's transient
#: per-token objects.
ENCODE_BATCH_BYTES = 256 << 10
#: ``array`` type codes of the shard dtypes.
_TYPECODES = {"uint16": "H", "uint32": "I"}


@dataclass
class EncodedRange:
    """``ids``: the range's token ids, little-endian ``dtype``, EOS after each document; and
    per-document bookkeeping."""

    ids: bytes
    doc_tokens: list[int]
    names: list[str]
    sha256: list[str]
    bytes_utf8: int


class RangeEncoder:
    """One tokenizer, encoding whole ranges with one thread."""

    def __init__(self, tokenizer_path: str, dtype: str, eos_id: int) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.typecode = _TYPECODES[dtype]
        if array.array(self.typecode).itemsize * 8 != int(dtype.removeprefix("uint")):
            raise RuntimeError(f"array type {self.typecode!r} does not hold {dtype} here")
        self.eos = [eos_id]

    def encode(self, rng: Range) -> EncodedRange:
        """Encode one spool range."""
        parts: list[list[int]] = []
        doc_tokens: list[int] = []
        names: list[str] = []
        shas: list[str] = []
        batch: list[str] = []
        batch_bytes = utf8 = 0

        def flush() -> None:
            for encoding in self.tokenizer.encode_batch_fast(batch, add_special_tokens=False):
                ids = encoding.ids
                parts.append(ids)
                parts.append(self.eos)
                doc_tokens.append(len(ids) + 1)
            batch.clear()

        for record in read_range(rng):
            batch.append(record.text.decode("utf-8"))
            names.append(record.name)
            shas.append(record.sha256.hex())
            batch_bytes += len(record.text)
            utf8 += len(record.text)
            if batch_bytes >= ENCODE_BATCH_BYTES:
                flush()
                batch_bytes = 0
        if batch:
            flush()
        ids = array.array(self.typecode, itertools.chain.from_iterable(parts))
        if sys.byteorder == "big":
            ids.byteswap()
        return EncodedRange(ids.tobytes(), doc_tokens, names, shas, utf8)


def serve(tokenizer_path: str, dtype: str, eos_id: int, requests: BinaryIO,
          replies: BinaryIO) -> None:
    """The worker's loop (see the module doc)."""
    encoder = RangeEncoder(tokenizer_path, dtype, eos_id)
    while True:
        try:
            rng = pickle.load(requests)
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", encoder.encode(rng))
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it
            reply = ("error", traceback.format_exc(limit=5))
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


if __name__ == "__main__":
    # Run the module's own copy, so that replies pickle as
    # trainforge.data.encode_worker.EncodedRange.
    from trainforge.data.encode_worker import serve as _serve

    _serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.stdin.buffer, sys.stdout.buffer)
