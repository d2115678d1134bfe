"""A host lost in the middle of a two-node Slurm job, for real: two test hosts (tests/hosts.py),
a slurmd on each, the trainer under srun + torchrun with one rank per node (gloo), a real MLflow
server on the submit host's test address.

Past the first checkpoint the second host's link goes down: its processes live on, but nothing
reaches them, as when a switch port or a NIC dies. The rank on the first host is left waiting in
an all-reduce and must give up within the job's collective timeout; the job then fails as
transient (Airflow would retry it). The link comes back, the controller returns the node to
service, and the retry -- the same job, try 2, on the same checkpoint folder of the shared file
system -- resumes from the newest valid checkpoint and ends at the planned step, with every
step's metrics in the MLflow run exactly once. Nothing of either try is left running on either
host.
"""

from __future__ import annotations

import re
import sys
import time

import psutil
import pytest

from trainforge.contract import FailureKind
from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.slurm.backend import SlurmBackend
from tests.faults.faultlib import wait_for
from tests.slurm_cluster import newest_step, two_host_slurm
from tests.trainer.conftest import build_dataset, make_job

pytestmark = [pytest.mark.multihost, pytest.mark.integration, pytest.mark.distributed]

MAX_STEPS = 100
COLLECTIVE_TIMEOUT_S = 15
SLURMD_TIMEOUT_S = 10




def _trainers(hosts, i: int) -> list[str]:
    """Command lines of trainer or torchrun processes still alive on host ``i``."""
    found = []
    for pid in hosts.pids(i):
        try:
            cmdline = " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue
        if "trainforge.trainer.train" in cmdline or "torch.distributed.run" in cmdline:
            found.append(cmdline)
    return found


@pytest.fixture
def two_hosts_cluster():
    with two_host_slurm("tf-slurm-loss-", slurmd_timeout_s=SLURMD_TIMEOUT_S) as (hosts, cluster):
        yield hosts, cluster


def test_a_lost_host_fails_the_job_as_transient_and_the_retry_resumes_exactly_once(
        tmp_path, two_hosts_cluster):
    import mlflow

    from trainforge.mlflow_setup import start_server

    hosts, cluster = two_hosts_cluster
    dataset = build_dataset(tmp_path / "data" / "tiny")
    config = make_job(dataset, tmp_path / "checkpoints",
                      optim={"max_steps": MAX_STEPS, "warmup_steps": 2},
                      checkpoint={"interval_steps": 10, "keep_last": 3},
                      logging={"log_every_steps": 1},
                      distributed={"collective_timeout_s": COLLECTIVE_TIMEOUT_S})
    backend = SlurmBackend(tmp_path / "runs")
    with start_server(tmp_path / "mlflow", host=hosts.submit_address, port=0,
                      allowed_hosts=f"{hosts.submit_address}:*", timeout_s=120.0) as server:
        client = mlflow.MlflowClient(server.url)
        run_id = client.create_run(client.create_experiment("node-loss")).info.run_id

        def job(try_number: int) -> TrainingJob:
            return TrainingJob(
                identity=JobIdentity("node_loss", "manual__1", "train", try_number),
                config={**config, "identity": {**config["identity"], "try_number": try_number}},
                module="trainforge.trainer.train", nodes=2, processes_per_node=1,
                env={"MLFLOW_TRACKING_URI": server.url, "MLFLOW_RUN_ID": run_id},
                engine_options={"python": sys.executable}, max_runtime_s=900.0,
                startup_timeout_s=120.0)

        first = backend.submit(job(1))
        log = backend.job_dir(job(1).identity) / "job.log"
        wait_for("the first try past its step-10 checkpoint", lambda: newest_step(log) >= 12
                 or backend.status(first).state.terminal, 240, 0.2)
        assert not backend.status(first).state.terminal, log.read_text()[-3000:]
        hosts.cut(1)
        cut_at, cut_step = time.monotonic(), newest_step(log)
        status = wait_for("the first try to end", lambda: (s := backend.status(first)).state.terminal
                          and s, COLLECTIVE_TIMEOUT_S + 4 * SLURMD_TIMEOUT_S + 60)
        noticed_s = time.monotonic() - cut_at
        text = log.read_text(errors="replace")
        assert status.state is JobState.FAILED, (status, text[-3000:])
        assert status.failure is FailureKind.TRANSIENT, (status, text[-3000:])
        # The rank left alone gave up in its all-reduce after the collective timeout (gloo's own
        # words), and the job ended soon after (srun tears the step down once a task fails; the
        # controller fails the job once the node misses SlurmdTimeout).
        assert f"Timed out waiting {COLLECTIVE_TIMEOUT_S * 1000}ms" in text, text[-3000:]
        assert newest_step(log) < cut_step + 5, text[-3000:]
        assert noticed_s < COLLECTIVE_TIMEOUT_S + 2 * SLURMD_TIMEOUT_S + 30, (noticed_s, status)

        hosts.restore(1)
        wait_for("both nodes back in service", cluster._node_idle, 120, 0.5)
        # The cut host's processes were killed when it came back (the job had ended).
        wait_for("no trainer left on the second host", lambda: not _trainers(hosts, 1), 60, 0.5)

        second = backend.submit(job(2))
        status = wait_for("the retry to end", lambda: (s := backend.status(second)).state.terminal
                          and s, 600, 0.5)
        retry_log = (backend.job_dir(job(2).identity) / "job.log").read_text(errors="replace")
        assert status.state is JobState.SUCCEEDED, (status, retry_log[-4000:])
        resumed = re.search(r"resuming from \S*step-(\d+)", retry_log)
        assert resumed, retry_log[-3000:]
        assert 10 <= int(resumed[1]) <= cut_step, (resumed[0], cut_step)
        assert f"step {MAX_STEPS}/{MAX_STEPS} |" in retry_log
        steps = sorted(m.step for m in client.get_metric_history(run_id, "train_loss"))
        assert steps == list(range(1, MAX_STEPS + 1)), steps
    for i in range(hosts.count):
        assert not _trainers(hosts, i), (i, _trainers(hosts, i))
