"""How many threads hash a checkpoint's files at once (one file per thread).

``hashlib`` releases the GIL while it hashes a buffer larger than 2 KiB, and reads into a
pre-allocated buffer release it too, so threads scale with cores as long as there is more than
one file: a checkpoint's weights and optimizer state are hashed side by side. One file is still
hashed by one thread (SHA-256 is sequential), so the slowest file sets the floor.

`trainforge.trainer.checkpoint.verify` hashes with these threads (local files and S3 objects
alike); ``bench/checkpoint_hash.py`` measures it against ``hashlib.sha256`` over the same bytes.
"""

from __future__ import annotations

import os

# Beyond this, threads only contend for the disk; checkpoints hold a handful of large files.
MAX_HASH_THREADS = 8


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def hash_threads(n_files: int, max_threads: int | None = None) -> int:
    """Threads used for ``n_files``: one per file, at most the usable cores and `MAX_HASH_THREADS`."""
    limit = max_threads if max_threads is not None else min(usable_cores(), MAX_HASH_THREADS)
    return max(1, min(n_files, limit))
