"""Encode the spooled documents into token shards with parallel worker processes.

Workers are ``python -m trainforge.data.encode`` subprocesses (not ``multiprocessing``: nothing
of the caller's ``__main__`` is re-imported, nothing is forked from a threaded parent). Each
loads the tokenizer once and encodes whole spool ranges with one tokenizer thread
(``TOKENIZERS_PARALLELISM=false``, ``RAYON_NUM_THREADS=1``); requests and replies are pickles
over its stdin and stdout. Range ``i`` goes to worker ``i % workers`` and each worker answers in
the order asked, so the parent reads the results in spool order and appends them to the split's
:class:`ShardWriter`: the shards are byte-identical whatever the number of workers. At most
``2 x workers`` ranges are in flight (bounded memory). A worker that dies or fails stops the
whole step with its message; closing its stdin ends it; so does the parent's death (EOF).

Per split it also writes ``<split>-documents.tsv``: one line per document, in shard order,
``sha256<TAB>tokens<TAB>name`` (tokens include the EOS after the document).
"""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from trainforge.data.errors import DataPrepError
from trainforge.data.manifest import sha256_file
from trainforge.data.shards import ShardWriter
from trainforge.data.spool import Range, read_range

#: Text per ``encode_batch`` call inside a worker (bytes): bounds the tokenizer's transient
#: per-token objects.
ENCODE_BATCH_BYTES = 256 << 10
#: Splits with at most this many documents also list their names inline in the manifest.
INLINE_NAMES_MAX = 10_000
#: Seconds a worker gets to exit after its stdin is closed.
WORKER_EXIT_TIMEOUT_S = 30

_worker: dict[str, Any] = {}


@dataclass
class EncodedRange:
    """``ids: (tokens,)`` of ``dtype``, EOS after each document; per-document bookkeeping."""

    ids: np.ndarray
    doc_tokens: list[int]
    names: list[str]
    sha256: list[str]
    bytes_utf8: int


def _init_worker(tokenizer_path: str, dtype: str, eos_id: int) -> None:
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_file(tokenizer_path), dtype=np.dtype(dtype),
                   eos=[eos_id])


def encode_range(rng: Range) -> EncodedRange:
    """Encode one spool range (in a worker process)."""
    tokenizer, dtype, eos = _worker["tokenizer"], _worker["dtype"], _worker["eos"]
    parts: list[list[int]] = []
    doc_tokens: list[int] = []
    names: list[str] = []
    shas: list[str] = []
    batch: list[str] = []
    batch_bytes = utf8 = 0

    def flush() -> None:
        for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False):
            ids = encoding.ids
            parts.append(ids)
            parts.append(eos)
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
    total = sum(doc_tokens)
    ids = np.fromiter(itertools.chain.from_iterable(parts), dtype=dtype, count=total)
    return EncodedRange(ids, doc_tokens, names, shas, utf8)


class _Worker:
    """One encoding subprocess and its pipes."""

    def __init__(self, tokenizer_path: Path, dtype: str, eos_id: int) -> None:
        # The installed package (wheel or editable) is importable by this interpreter as it is.
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainforge.data.encode", str(tokenizer_path), dtype,
             str(eos_id)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def send(self, rng: Range) -> None:
        assert self.proc.stdin is not None
        pickle.dump(rng, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.flush()

    def receive(self) -> EncodedRange:
        assert self.proc.stdout is not None
        try:
            status, value = pickle.load(self.proc.stdout)
        except EOFError:
            code = self.proc.wait()
            raise DataPrepError(f"encoding worker {self.proc.pid} exited with code {code} "
                                "before answering (see its stderr above)") from None
        if status != "ok":
            raise DataPrepError(f"encoding worker {self.proc.pid} failed: {value}")
        return value

    def close(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        elif self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=WORKER_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


def encode_splits(tokenizer_path: Path, splits: dict[str, list[Range]], *, folder: Path,
                  dtype: str, shard_tokens: int, eos_id: int, workers: int
                  ) -> tuple[dict[str, dict[str, Any]], float]:
    """Encode every split's ranges into ``folder``; returns (manifest split entries, seconds).

    Raises:
        DataPrepError: a worker failed or died (the others are stopped first).
    """
    started = time.monotonic()
    pool = [_Worker(tokenizer_path, dtype, eos_id) for _ in range(workers)]
    out: dict[str, dict[str, Any]] = {}
    try:
        for split, ranges in splits.items():
            out[split] = _encode_split(pool, split, ranges, folder, dtype, shard_tokens)
    except BaseException:
        for worker in pool:
            worker.close(kill=True)
        raise
    for worker in pool:
        worker.close()
    return out, time.monotonic() - started


def _encode_split(pool: list[_Worker], split: str, ranges: list[Range], folder: Path,
                  dtype: str, shard_tokens: int) -> dict[str, Any]:
    writer = ShardWriter(folder, split, dtype, shard_tokens)
    index_name = f"{split}-documents.tsv"
    entry: dict[str, Any] = {"documents": 0, "tokens": 0, "bytes_utf8": 0}
    names: list[str] = []
    sent = received = 0
    with open(folder / index_name, "w", encoding="utf-8", newline="\n") as index:
        def take() -> None:
            nonlocal received
            result = pool[received % len(pool)].receive()
            received += 1
            writer.write(result.ids)
            entry["documents"] += len(result.names)
            entry["tokens"] += int(result.ids.size)
            entry["bytes_utf8"] += result.bytes_utf8
            for sha, tokens, name in zip(result.sha256, result.doc_tokens, result.names):
                safe = name.replace("\t", "\\t").replace("\n", "\\n")
                index.write(f"{sha}\t{tokens}\t{safe}\n")
            if len(names) <= INLINE_NAMES_MAX:
                names.extend(result.names)

        try:
            for rng in ranges:
                pool[sent % len(pool)].send(rng)
                sent += 1
                if sent - received >= 2 * len(pool):
                    take()
            while received < sent:
                take()
        finally:
            entry["shards"] = writer.close()
    size, sha = sha256_file(folder / index_name)
    entry["index"] = {"file": index_name, "bytes": size, "sha256": sha}
    if entry["documents"] <= INLINE_NAMES_MAX:
        entry["document_names"] = names
    return entry


def _serve(tokenizer_path: str, dtype: str, eos_id: int, requests: BinaryIO,
           replies: BinaryIO) -> None:
    """The worker's loop: a pickled :class:`Range` in, ``("ok", EncodedRange)`` or
    ``("error", traceback)`` out, until EOF."""
    _init_worker(tokenizer_path, dtype, eos_id)
    while True:
        try:
            rng = pickle.load(requests)
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", encode_range(rng))
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it
            reply = ("error", traceback.format_exc(limit=5))
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


if __name__ == "__main__":
    # Run the module's own copy, so that replies pickle as trainforge.data.encode.EncodedRange.
    from trainforge.data.encode import _serve as serve

    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.stdin.buffer, sys.stdout.buffer)
