"""A hung rank (SIGSTOP: alive, silent) is noticed within the collective timeout, not 30 min.

2 ranks under torchrun (gloo) with one elastic restart: after the first checkpoint one rank is
stopped; the other's next collective times out after ``distributed.collective_timeout_s``, it
exits, torchrun stops the group (SIGKILL reaches the stopped rank) and starts it again, and the
new group resumes from the checkpoint and finishes at the planned step.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from faultlib import wait_for
from tests.trainer.conftest import REPO_ROOT, make_job, trainer_env, write_job

pytestmark = [pytest.mark.distributed]

MAX_STEPS = 30
COLLECTIVE_TIMEOUT_S = 8


def test_hung_rank_is_detected_within_the_collective_timeout_and_the_group_restarts(
        tmp_path, tiny_dataset):
    job = write_job(tmp_path / "job.json", make_job(
        tiny_dataset, tmp_path / "ck", optim={"max_steps": MAX_STEPS, "warmup_steps": 2},
        checkpoint={"interval_steps": 10, "keep_last": 2}, logging={"log_every_steps": 1},
        distributed={"backend": "gloo", "collective_timeout_s": COLLECTIVE_TIMEOUT_S},
    ))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "--max-restarts=1", "-m", "trainforge.trainer.train", "--config", str(job)]
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=trainer_env(tmp_path / "result.json"),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("the step-10 checkpoint", lambda: proc.poll() is not None or
                 (tmp_path / "ck" / "step-00000010" / "manifest.json").exists(), 240, 0.05)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "trainforge.trainer.train" in p.cmdline()]
        victim = next(p for p in ranks if "RANK" in p.environ() and p.environ()["RANK"] == "1")
        victim.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        # The group restarts: a second "model:" line from the new rank 0.
        wait_for("the restarted group", lambda: len(re.findall(
            r"rank0 INFO trainforge.trainer.train: model:", log_path.read_text(errors="replace"))) >= 2,
            COLLECTIVE_TIMEOUT_S + 120, 0.2)
        noticed_s = time.monotonic() - stopped_at
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
                p.kill()
            proc.wait()
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    # Noticed and restarted in seconds (timeout + restart), nowhere near the 30-min default.
    assert noticed_s < COLLECTIVE_TIMEOUT_S + 90, noticed_s
    assert "resuming from" in text
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_step"] == MAX_STEPS and result["status"] == "success"
    assert not psutil.pid_exists(victim.pid) or victim.status() == psutil.STATUS_ZOMBIE
