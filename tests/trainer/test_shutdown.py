"""A rank that does not reach the final barrier after training: named, and reported as such.

Two plain processes (gloo, loopback, 3 s collective timeout): rank 0 finishes and calls
``shut_down``; rank 1 stays away from the barrier (as if blocked in a stray collective) until
rank 0 has reported.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from trainforge.trainer.distributed import barrier_failure
from trainforge.trainer.train import after_training_failure

pytestmark = [pytest.mark.distributed]

SCRIPT = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    from trainforge.trainer.distributed import shut_down

    report = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=3))
    if dist.get_rank() == 0:
        report.write_text(repr(shut_down(True, 0, timeout_s=3)))
    else:
        deadline = time.monotonic() + 60
        while not report.exists() and time.monotonic() < deadline:  # away from the barrier
            time.sleep(0.05)
        os._exit(1)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_final_barrier_names_the_rank_that_did_not_arrive(tmp_path):
    script, report = tmp_path / "ranks.py", tmp_path / "report.txt"
    script.write_text(SCRIPT)
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script), str(report)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 0, outputs[0][-3000:]
    # Noticed within the collective timeout, not after rank 1 gave up waiting (60 s).
    assert procs[1].returncode == 1, outputs[1][-3000:]
    assert report.read_text() == repr("collective timeout on rank 1"), outputs[0][-3000:]


@pytest.mark.parametrize("error, expected", [
    ("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 8000 ms", "collective timeout on rank 1, 3"),
    ("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 8000 ms", "collective timeout on rank 2"),
    ("Connection closed by peer [127.0.0.1]:1234", "collective failure: RuntimeError: Connection closed by "
                                                   "peer [127.0.0.1]:1234"),
])
def test_barrier_failure_names_the_ranks(error, expected):
    assert barrier_failure(RuntimeError(error)) == expected


def test_a_finished_training_whose_ranks_did_not_all_leave_is_its_own_failure():
    finished = {"status": "success", "exit_code": 0, "message": "finished at step 40", "final_step": 40,
                "tokens_seen": 640, "final_train_loss": 3.2, "last_checkpoint": "/ck/step-00000040"}
    result = after_training_failure(finished, "collective timeout on rank 1")
    assert result["status"] == "error" and result["exit_code"] == 1 and result["phase"] == "after_training"
    assert result["message"] == ("post-training collective timeout on rank 1; the final checkpoint at step 40 "
                                 "is complete (/ck/step-00000040)")
    assert result["last_checkpoint"] == "/ck/step-00000040" and result["final_step"] == 40
