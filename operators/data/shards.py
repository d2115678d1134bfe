"""Write token ids into flat little-endian shard files (docs/contracts.md, "Dataset").

``<split>-00000.bin``, ``<split>-00001.bin``, ...: each is a raw array of ``uint16`` (or
``uint32``) token ids, no header; documents are concatenated with the EOS id after each one
(including the last); :mod:`trainforge.data.encode` produces them. A shard holds at most
``shard_tokens`` ids; a document may straddle two shards (readers treat a split as one stream).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np


class ShardWriter:
    """Append token arrays to ``<split>-NNNNN.bin`` files of at most ``shard_tokens`` ids."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.folder = folder
        self.split = split
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._hash: Any = None
        self._count = 0
        self._name = ""

    def write(self, ids: np.ndarray) -> None:
        """Append ``ids: (n,)`` integer ids, splitting across shards as needed."""
        data = np.ascontiguousarray(ids, dtype=self.dtype)
        while data.size:
            if self._file is None:
                self._open()
            take = min(self.shard_tokens - self._count, data.size)
            chunk = data[:take].tobytes()
            self._file.write(chunk)
            self._hash.update(chunk)
            self._count += take
            data = data[take:]
            if self._count == self.shard_tokens:
                self._close()

    def close(self) -> list[dict[str, Any]]:
        """Finish the open shard; returns the shard entries of the manifest."""
        if self._file is not None:
            self._close()
        return self.shards

    def _open(self) -> None:
        self._name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.folder / self._name, "wb")
        self._hash = hashlib.sha256()
        self._count = 0

    def _close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards.append({
            "file": self._name,
            "bytes": self._count * self.dtype.itemsize,
            "sha256": self._hash.hexdigest(),
            "tokens": self._count,
        })
        self._file = None
