"""An elastic restart under the engines' launch environment gets a fresh rendezvous.

torchrun keeps one TCPStore across elastic restarts when it shares it with the workers (the
default since torch 2.5), with no per-attempt key prefix: in the restarted group a fast rank 0 can
read a slow peer's gloo address from the *previous* attempt and fail with "Connection refused"
(pytorch/pytorch#135712). The engines set ``LAUNCH_ENV`` (operators/engines/launch.py) to opt out.
This test makes rank 1 deliberately slow in the second attempt (without that setting the restarted
group failed in 3 of 5 runs here, with that error or a connect timeout) and checks the restarted
group comes up and finishes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from trainforge.engines.launch import LAUNCH_ENV
from tests.trainer.conftest import REPO_ROOT, trainer_env

pytestmark = [pytest.mark.distributed]

WORKER = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 1 and rank == 1:
        time.sleep(6)  # a slow peer: rank 0 reaches the rendezvous first
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    dist.barrier()
    print(f"attempt {attempt} rank {rank} up", flush=True)
    if attempt == 0:
        if rank == 0:
            os._exit(1)  # the failure torchrun restarts the group for
        time.sleep(120)  # rank 1 waits to be stopped by torchrun
    dist.barrier()
    print(f"attempt {attempt} rank {rank} done", flush=True)
    dist.destroy_process_group()
""")


def test_restarted_group_with_a_slow_rank_comes_up(tmp_path):
    assert LAUNCH_ENV.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--max-restarts=1", str(script)],
        cwd=REPO_ROOT, env=trainer_env(tmp_path / "result.json"), capture_output=True, text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "attempt 1 rank 0 done" in out and "attempt 1 rank 1 done" in out, out[-4000:]
    assert "Connection refused" not in out
