"""Encode the spooled documents into token shards with parallel worker processes.

Workers are ``python -m trainforge.data.encode_worker`` subprocesses (not ``multiprocessing``:
nothing of the caller's ``__main__`` is re-imported, nothing is forked from a threaded parent).
Each loads the tokenizer once and encodes whole spool ranges with one tokenizer thread
(``TOKENIZERS_PARALLELISM=false``, ``RAYON_NUM_THREADS=1``); requests and replies are pickles
over its stdin and stdout. The splits' ranges form one queue (the workers do not wait for one
split's last range before starting the next); range ``i`` of it goes to worker
``i % workers`` and each worker answers in the order asked, so the parent reads the results in
spool order and appends them to the split's :class:`ShardWriter`: the shards are byte-identical whatever the number of workers. At most
``2 x workers`` ranges are in flight (bounded memory). A worker that dies or fails stops the
whole step with its message; closing its stdin ends it; so does the parent's death (EOF).

Per split it also writes ``<split>-documents.tsv``: one line per document, in shard order,
``sha256<TAB>tokens<TAB>name`` (tokens include the EOS after the document).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainforge.data.encode_worker import EncodedRange
from trainforge.data.errors import DataPrepError
from trainforge.storage.files import sha256_file
from trainforge.data.shards import ShardWriter
from trainforge.data.spool import Range

#: Splits with at most this many documents also list their names inline in the manifest.
INLINE_NAMES_MAX = 10_000
#: Seconds a worker gets to exit after its stdin is closed.
WORKER_EXIT_TIMEOUT_S = 30


class _Worker:
    """One encoding subprocess and its pipes."""

    def __init__(self, tokenizer_path: Path, dtype: str, eos_id: int) -> None:
        # The installed package (wheel or editable) is importable by this interpreter as it is.
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainforge.data.encode_worker", str(tokenizer_path), dtype,
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

    The splits' ranges form one queue, so the workers keep encoding the next split while the
    last ranges of the previous one are written.

    Raises:
        DataPrepError: a worker failed or died (the others are stopped first).
    """
    started = time.monotonic()
    pool = [_Worker(tokenizer_path, dtype, eos_id) for _ in range(workers)]
    sinks = {split: _SplitSink(folder, split, dtype, shard_tokens) for split in splits}
    jobs = [(split, rng) for split, ranges in splits.items() for rng in ranges]
    sent = received = 0
    try:
        try:
            for _, rng in jobs:
                pool[sent % workers].send(rng)
                sent += 1
                if sent - received >= 2 * workers:
                    sinks[jobs[received][0]].add(pool[received % workers].receive())
                    received += 1
            while received < sent:
                sinks[jobs[received][0]].add(pool[received % workers].receive())
                received += 1
        finally:
            out = {split: sink.close() for split, sink in sinks.items()}
    except BaseException:
        for worker in pool:
            worker.close(kill=True)
        raise
    for worker in pool:
        worker.close()
    return out, time.monotonic() - started


class _SplitSink:
    """One split's shards, document index and manifest entry, fed in spool order."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.folder = folder
        self.writer = ShardWriter(folder, split, dtype, shard_tokens)
        self.index_name = f"{split}-documents.tsv"
        self.index = open(folder / self.index_name, "w", encoding="utf-8", newline="\n")
        self.entry: dict[str, Any] = {"documents": 0, "tokens": 0, "bytes_utf8": 0}
        self.names: list[str] = []

    def add(self, result: EncodedRange) -> None:
        ids = np.frombuffer(result.ids, dtype=self.writer.dtype)
        self.writer.write(ids)
        self.entry["documents"] += len(result.names)
        self.entry["tokens"] += int(ids.size)
        self.entry["bytes_utf8"] += result.bytes_utf8
        for sha, tokens, name in zip(result.sha256, result.doc_tokens, result.names):
            safe = name.replace("\t", "\\t").replace("\n", "\\n")
            self.index.write(f"{sha}\t{tokens}\t{safe}\n")
        if len(self.names) <= INLINE_NAMES_MAX:
            self.names.extend(result.names)

    def close(self) -> dict[str, Any]:
        """Finish the shards and the index; returns the split's manifest entry."""
        self.entry["shards"] = self.writer.close()
        self.index.close()
        index = self.folder / self.index_name
        size, sha = index.stat().st_size, sha256_file(index)
        self.entry["index"] = {"file": self.index_name, "bytes": size, "sha256": sha}
        if self.entry["documents"] <= INLINE_NAMES_MAX:
            self.entry["document_names"] = self.names
        return self.entry
