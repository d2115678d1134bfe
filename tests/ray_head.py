"""The ``ray_head`` fixture: a real Ray head on loopback for the test session.

Registered in tests/conftest.py. Started on first use (``ray start --head`` on 127.0.0.1, free
ports, a short temporary folder, 2 logical CPUs, a 200 MB object store) and stopped at the end
of the session, also when tests fail, with no grace period: every process of the head is
killed (gcs_server and the autoscaler's monitor ignore SIGTERM, so a grace was always waited out
in full, and the head is thrown away); the teardown fails the session if one survives. Jobs run
with ``TMPDIR`` inside the head's temporary folder (``head.job_tmp_dir``), which is removed at
the end: their job folders go with it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_head() -> Iterator[object]:
    """A started :class:`trainforge.engines.ray.head.LocalRayHead`; ``.address`` is the job API."""
    import psutil

    from trainforge.engines.ray.head import LocalRayHead

    # Ray's socket paths must stay under 107 bytes: pytest's tmp_path is often too deep.
    temp_dir = tempfile.mkdtemp(prefix="tf-ray-")
    head = LocalRayHead(temp_dir, num_cpus=2, object_store_mib=200, stop_grace_s=0.0)
    try:
        head.start()
        yield head
    finally:
        head.stop()
        leftovers = [p for p in head._processes() if p.is_running()
                     and p.status() != psutil.STATUS_ZOMBIE]
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leftovers, f"Ray processes left after stopping the head: {leftovers}"
