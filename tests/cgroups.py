"""A memory cgroup a test makes for its own child processes, and removes afterwards."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import skip_without
from trainforge.contract import cgroup_memory


def limit_file(folder: Path) -> Path:
    """The cgroup's limit: v2 ``memory.max``, else v1 ``memory.limit_in_bytes``."""
    return folder / "memory.max" if (folder / "memory.max").exists() else folder / "memory.limit_in_bytes"


@contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A new cgroup below this process's memory cgroup, limited to ``limit_bytes``; skips the test
    where none can be made. A child joins it by writing its pid to ``cgroup.procs``; at the end
    every process in it (the test's own children) is SIGKILLed and the cgroup removed."""
    mem = cgroup_memory()
    if mem is None:
        skip_without("cgroup", "no memory cgroup can be read from /proc/self/cgroup")
    folder = Path(mem["dir"]) / f"trainforge-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
    except OSError as err:
        skip_without("cgroup", f"cannot make one under {mem['dir']}: {err}")
    try:
        if not limit_file(folder).exists():
            skip_without("cgroup", f"{mem['dir']} does not delegate the memory controller to its children")
        limit_file(folder).write_text(str(limit_bytes))
        yield folder
    finally:
        deadline = time.monotonic() + 30
        while (pids := (folder / "cgroup.procs").read_text().split()) and time.monotonic() < deadline:
            for pid in pids:  # only this test's children joined it
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        while True:
            try:
                folder.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
