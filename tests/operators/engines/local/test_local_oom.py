"""A rank the kernel's OOM killer ends is named so in the job's failure (trainforge.engines.host_oom).

A real local job in a memory cgroup the test makes: its rank notes a checkpoint phase and then
allocates past the limit. The torchrun summary, Slurm's OUT_OF_MEMORY and a SIGKILL no cgroup
counted are read from files.
"""

from __future__ import annotations

import os
import stat
import sys
import textwrap
import time
from pathlib import Path

from trainforge.contract import phase_file
from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.host_oom import describe, signalled_ranks
from trainforge.engines.local.backend import LocalBackend

from tests.cgroups import memory_cgroup

RANK = textwrap.dedent("""
    import os, sys
    from trainforge.contract import phase_file
    path = phase_file(os.environ["TRAINFORGE_JOB_DIR"], int(os.environ["RANK"]))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write("staging checkpoint step 20 (pageable)")
    held = []
    while True:  # past the cgroup's limit: the kernel's OOM killer ends this process
        held.append(b"x" * (32 << 20))
""")

SUMMARY = """\
[W] torch.distributed.elastic.multiprocessing.api: failed (exitcode: -9) local_rank: 1 (pid: 4242) of binary: python
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : node-a
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
"""


def test_a_local_rank_killed_by_the_oom_killer_is_named_with_its_phase(tmp_path):
    with memory_cgroup(768 * 2**20) as folder:
        python = tmp_path / "python"  # the supervisor and torchrun join the cgroup, the rank with them
        python.write_text(f'#!/bin/sh\necho $$ > {folder / "cgroup.procs"}\nexec {sys.executable} "$@"\n')
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
        (tmp_path / "oom_rank.py").write_text(RANK)
        backend = LocalBackend(tmp_path / "runs", python=str(python), cwd=str(tmp_path))
        job = TrainingJob(identity=JobIdentity("oom", "manual__1", "train", 1), config={}, module="oom_rank",
                          processes_per_node=1, env={"PYTHONPATH": os.getcwd()})
        handle = backend.submit(job)
        deadline = time.monotonic() + 90
        while not (status := backend.status(handle)).state.terminal:
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.2)
    assert status.state is JobState.FAILED, status
    assert status.message.startswith(
        "rank 0 was killed by the kernel's OOM killer (the job's cgroup counted 1 OOM kill(s)); rank 0's last "
        "phase: staging checkpoint step 20 (pageable); the host ran out of memory"), status.message


def test_slurm_out_of_memory_and_a_sigkill_no_cgroup_counted_are_told_apart(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("step 19/40\n" + SUMMARY)
    assert signalled_ranks(SUMMARY) == {1: 9}
    phase = Path(phase_file(str(tmp_path), 1))
    phase.parent.mkdir()
    phase.write_text("training after checkpoint step 20")
    oom = describe(tmp_path, [log], oom_state="OUT_OF_MEMORY")
    assert oom.startswith("rank 1 was killed by the kernel's OOM killer (the scheduler says OUT_OF_MEMORY); "
                          "rank 1's last phase: training after checkpoint step 20"), oom
    killed = describe(tmp_path, [log], oom_kills=0)
    assert killed.startswith("rank 1 was killed by SIGKILL (signal 9); rank 1's last phase") and "no cgroup" in killed
    log.write_text("step 19/40\nexitcode  : 1\n")
    assert describe(tmp_path, [log], oom_kills=0) is None  # an ordinary failure keeps its own message
