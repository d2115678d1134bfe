"""An elastic two-node Slurm job (``resources.nodes: {min: 1, max: 2}``), for real: two test
hosts (tests/hosts.py), a slurmd on each, the trainer under srun + torchrun, one rank per node
(gloo), ``max_restarts: 1``.

Past the first checkpoint a node is lost (its torchrun agent and rank SIGKILLed, as when the
machine dies under them):

* the second node: the first node's agent restarts its worker group alone, the trainer resumes
  the newest checkpoint at world size 1 (the global batch kept by accumulation), the job reaches
  ``max_steps`` without a new allocation, and its status names the lost node;
* the first node, the c10d store's host: the job fails at once naming it, and the task's retry
  is kept off it (``--exclude``), so its rendezvous runs on the survivor's address and it
  finishes there.

Nothing of a job is left running on either host after each.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.slurm.backend import SlurmBackend
from trainforge.ledger.attempts import attempt_records, job_dir_records
from trainforge.ledger.disruptions import NODE_LOSS, disruption_figures
from trainforge.ledger.tries import try_ended
from tests.faults.faultlib import wait_for
from tests.slurm_cluster import JOB_WORDS, job_logs, newest_step, two_host_slurm
from tests.trainer.conftest import build_dataset, make_job

pytestmark = [pytest.mark.multihost, pytest.mark.integration, pytest.mark.distributed]

MAX_STEPS = 120
LOSE_AFTER_STEP = 12


@pytest.fixture(scope="module")
def cluster():
    with two_host_slurm("tf-slurm-el-") as (hosts, slurm):
        yield hosts, slurm


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return build_dataset(tmp_path_factory.mktemp("data") / "tiny")


def _job(tmp_path: Path, dataset: Path, key: str) -> TrainingJob:
    config = make_job(dataset, tmp_path / "checkpoints",
                      optim={"max_steps": MAX_STEPS, "warmup_steps": 1},
                      checkpoint={"interval_steps": 10, "keep_last": 2},
                      logging={"log_every_steps": 1},
                      distributed={"collective_timeout_s": 20})
    return TrainingJob(identity=JobIdentity("elastic", key, "train", 1), config=config,
                       module="trainforge.trainer.train", nodes=2, min_nodes=1,
                       processes_per_node=1, engine_options={"python": sys.executable},
                       max_runtime_s=600.0, startup_timeout_s=60.0, max_restarts=1)






def _lose_node(backend, handle, job, hosts, i: int) -> float:
    """Past the first checkpoint, SIGKILL host ``i``'s torchrun agent and its ranks."""
    log = backend.job_dir(job.identity) / "job.log"
    wait_for("the job past its step-10 checkpoint", lambda: newest_step(log) >= LOSE_AFTER_STEP
             or backend.status(handle).state.terminal, 240, 0.2)
    assert not backend.status(handle).state.terminal, job_logs(backend, job)[-3000:]
    # (on the first node srun's own command line names torchrun too: srun is not the agent)
    agents = [p for p in hosts.processes(i, "torch.distributed.run") if p.name() != "srun"]
    assert agents, job_logs(backend, job)[-3000:]
    for proc in [p for a in agents for p in a.children(recursive=True)] + agents:
        proc.kill()
    return time.monotonic()


def _wait_end(backend, handle, timeout_s: float):
    return wait_for("the job to end", lambda: (s := backend.status(handle)).state.terminal and s,
                    timeout_s, 0.5)




def test_losing_a_node_goes_on_with_the_survivor_to_max_steps(tmp_path, cluster, dataset):
    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, "second")
    handle = backend.submit(job)
    script = (backend.job_dir(job.identity) / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1-2" in script and "--nnodes=1:" in script, script
    _lose_node(backend, handle, job, hosts, 1)
    killed_at = time.time()
    status = _wait_end(backend, handle, 300)
    text = job_logs(backend, job)
    print(status.message)  # what Airflow's task log shows (pytest -s)
    assert status.state is JobState.SUCCEEDED, (status, text[-4000:])
    # One job, one run of its script: the survivor went on inside the same allocation.
    assert len(re.findall(r"trainforge: Slurm job \d+ on", text)) == 1, text[-4000:]
    assert f"step {MAX_STEPS}/{MAX_STEPS} |" in text, text[-4000:]
    resumed = re.findall(r"resuming from \S*step-(\d+)", text)
    assert resumed and int(resumed[-1]) >= 10, (resumed, text[-4000:])
    assert re.search(r"trained on world size 2, this attempt runs 1 ranks", text), text[-4000:]
    assert "micro 2 x world 1 x accum 4" in text, text[-4000:]  # the global batch kept
    loss = status.result["disruption"]
    assert loss["kind"] == NODE_LOSS and loss["node"] == hosts.name(1), loss
    assert loss["survivors"] == [hosts.name(0)], loss
    assert hosts.name(1) in status.message, status.message
    # Its last sign of life is its rank's record, renewed while it trained up to the kill (its
    # rank prints nothing); detected when the survivor's ranks stopped (their collective failed).
    assert killed_at - 5 < loss["lost_at"] <= killed_at + 1.5, (loss, killed_at)
    assert 0 <= loss["detection_s"] < 15 and loss["elastic"] is True, loss
    assert "its survivors noticed" in status.message, status.message
    # The run record: the succeeded try's record keeps the loss, and the ledger names the node
    # and the steps trained again on the survivor (from the job's attempt records).
    event = {"status": "success", "message": status.message, "handle": handle,
             "result": status.result, "ended_at_epoch_s": status.ended_at_epoch_s}
    record = try_ended(None, 1, None, event, time.time())
    assert record["disruption"]["node"] == hosts.name(1), record
    attempts = attempt_records(job_dir_records(backend.job_dir(job.identity)))
    assert len(attempts) == 2, attempts
    metrics, tags = disruption_figures([record], records=attempts)
    assert metrics[f"disruptions/{NODE_LOSS}"] == 1.0, metrics
    # The survivor resumed at the newest complete checkpoint and trained again every step the
    # lost attempt had reached past it: none only when the node went just as a checkpoint
    # completed (the kill lands where the polling finds it, a step or several past step 12).
    resumed_at, reached = attempts[1]["resumed_step"], attempts[1]["reached_step"]
    assert resumed_at == int(resumed[-1]) and reached >= LOSE_AFTER_STEP, attempts
    recomputed = reached - resumed_at
    assert recomputed >= 1 or reached % 10 == 0, attempts
    assert metrics[f"disruptions/{NODE_LOSS}/steps_recomputed"] == recomputed, (metrics, attempts)
    assert tags[f"ledger/disruptions/{NODE_LOSS}"].startswith(f"try 1: {hosts.name(1)}"), tags
    hosts.wait_nothing_left(JOB_WORDS)


def test_losing_the_store_host_fails_fast_and_the_retry_runs_on_the_survivor(
        tmp_path, cluster, dataset):
    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, "store-host")
    handle = backend.submit(job)
    lost = _lose_node(backend, handle, job, hosts, 0)
    status = _wait_end(backend, handle, 120)
    took = time.monotonic() - lost
    text = job_logs(backend, job)
    print(status.message, f"({took:.1f} s)")
    assert status.state is JobState.FAILED, (status, text[-4000:])
    assert status.result["disruption"]["node"] == hosts.name(0), status.result
    assert took < 60, (took, text[-4000:])
    hosts.wait_nothing_left(JOB_WORDS)

    retry = replace(job, identity=replace(job.identity, try_number=2))
    handle2 = backend.submit(retry)
    script = (backend.job_dir(retry.identity) / "job.sbatch").read_text()
    assert f"#SBATCH --exclude={hosts.name(0)}" in script, script
    status2 = _wait_end(backend, handle2, 300)
    text2 = job_logs(backend, retry)
    assert status2.state is JobState.SUCCEEDED, (status2, text2[-4000:])
    started = re.search(r"trainforge: Slurm job \d+ on (\S+); rendezvous (\S+):\d+", text2)
    assert started and started[1] == hosts.name(1), text2[-3000:]
    assert started[2] == hosts.address(1), (started[2], hosts.addresses)
    assert f"step {MAX_STEPS}/{MAX_STEPS} |" in text2
    hosts.wait_nothing_left(JOB_WORDS)
