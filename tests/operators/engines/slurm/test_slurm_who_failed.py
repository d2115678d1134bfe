"""A Slurm job whose rank raises names that rank, its node and the raising line, for real: the
session's one-node Slurm cluster (tests/slurm_cluster.py), the trainer under srun + torchrun on 2
gloo ranks, rank 1's optimizer made to raise at step 5 by a ``sitecustomize`` on the job's path
(tests/faults/test_who_failed.py's). Rank 0 fails next in its collective; the failure is told from
rank 1, with rank 0 as collateral.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.slurm.backend import SlurmBackend
from tests.faults.test_who_failed import INJECT
from tests.slurm_cluster import slurm_cluster  # noqa: F401 - the session's Slurm cluster
from tests.trainer.conftest import build_dataset, make_job

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


def test_a_raising_rank_is_named_in_the_slurm_jobs_failure(tmp_path, slurm_cluster):  # noqa: F811
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    config = make_job(build_dataset(tmp_path / "data" / "tiny"), tmp_path / "checkpoints",
                      optim={"max_steps": 20, "warmup_steps": 2},
                      distributed={"backend": "gloo", "collective_timeout_s": 20})
    backend = SlurmBackend(tmp_path / "runs")
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p)
    job = TrainingJob(identity=JobIdentity("who_failed", "manual__1", "train", 1), config=config,
                      module="trainforge.trainer.train", nodes=1, processes_per_node=2,
                      env={"PYTHONPATH": path, "TF_TEST_RAISE_AT_STEP": "5", "HF_HUB_OFFLINE": "1"},
                      engine_options={"python": sys.executable}, max_runtime_s=600.0,
                      startup_timeout_s=120.0)
    handle = backend.submit(job)
    deadline = time.monotonic() + 300
    while not (status := backend.status(handle)).state.terminal:
        assert time.monotonic() < deadline, "the Slurm job did not end in 300 s"
        time.sleep(0.5)
    log = (Path(handle["job_dir"]) / "job.log").read_text(errors="replace")
    assert status.state is JobState.FAILED, (status, log[-3000:])
    assert "rank 1 on " in status.message and " raised ValueError during step 5: injected at optimizer " \
        "step 5" in status.message, (status.message, log[-3000:])
    assert 'sitecustomize.py", line 11, in step' in status.message, status.message
    assert "collateral: rank 0 on " in status.message, status.message
    assert status.result["root_cause"]["culprits"][0]["rank"] == 1
