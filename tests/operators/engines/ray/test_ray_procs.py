"""What the Ray launcher stops on a node after a failed job: every process its node job folder
names, a rank that ignores SIGTERM too (procs.reap, on this machine)."""

from __future__ import annotations

import subprocess
import sys
import uuid

from trainforge.engines.ray import procs

IGNORES_TERM = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
               "print('ready', flush=True); time.sleep(120)"


def _start(marker: str, code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, f"--config={marker}1.x/job.json"],
                            stdout=subprocess.PIPE, start_new_session=True)  # as torchrun's ranks
    if "ready" in code:
        assert proc.stdout.readline().strip() == b"ready"
    return proc


def test_reap_stops_what_the_job_left_and_nothing_else():
    marker = f"trainforge-test-{uuid.uuid4().hex[:8]}.node-"
    stubborn = _start(marker, IGNORES_TERM)
    polite = _start(marker, "import time; time.sleep(120)")
    other = _start("trainforge-other.node-", "import time; time.sleep(120)")
    try:
        assert sorted(procs.leftovers(marker)) == sorted([stubborn.pid, polite.pid])
        found = procs.reap(marker, grace_s=1.0)
        assert sorted(found) == sorted([stubborn.pid, polite.pid])
        assert stubborn.wait(10) == -9 and polite.wait(10) == -15  # SIGKILL after the grace
        assert procs.leftovers(marker) == [] and other.poll() is None
    finally:
        for proc in (stubborn, polite, other):
            proc.kill()
            proc.wait()
