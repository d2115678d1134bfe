"""Which node a two-node Slurm job lost, for real: two test hosts (tests/hosts.py), a slurmd on
each, a stand-in workload (fake_trainer.py, printing a line every 0.2 s) under srun + torchrun,
one rank per node.

* the second host's torchrun agent is killed with its rank: srun ends the step at once, and the
  job's failure names that node -- from srun's first task-end line -- and not the survivor;
* every process of the second host is killed (a machine that dies, slurmd included): the
  controller marks it down after ``SlurmdTimeout`` and fails the job; the failure names it.

Each time the failed status carries the ``node_loss`` disruption the ledger attributes its badput
to (the node, its last sign of life, the report's delay), the train task's try record keeps it,
and nothing of the job is left on either host.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from trainforge.contract import FailureKind
from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.slurm.backend import SlurmBackend
from trainforge.ledger.disruptions import NODE_LOSS, event_disruption
from trainforge.ledger.tries import try_ended
from tests.faults.faultlib import wait_for
from tests.slurm_cluster import job_logs, two_host_slurm

pytestmark = [pytest.mark.multihost, pytest.mark.integration, pytest.mark.distributed]

FAKES = Path(__file__).resolve().parents[1]  # fake_trainer.py
SLURMD_TIMEOUT_S = 10
WORDS = ("fake_trainer", "node_preflight", "torch.distributed.run")


@pytest.fixture(scope="module")
def cluster():
    with two_host_slurm("tf-slurm-nl-", slurmd_timeout_s=SLURMD_TIMEOUT_S) as (hosts, slurm):
        yield hosts, slurm


def _job(key: str) -> TrainingJob:
    return TrainingJob(identity=JobIdentity("node_loss_named", key, "train", 1),
                       config={"fake": {"lines": 3000, "line_sleep_s": 0.2}},
                       module="fake_trainer", nodes=2, processes_per_node=1,
                       engine_options={"python": sys.executable, "working_dir": str(FAKES)},
                       max_runtime_s=600.0, startup_timeout_s=60.0)




def _running_on_both(backend, handle, job, hosts) -> None:
    ranks = backend.job_dir(job.identity) / "ranks" / "node-1.log"
    wait_for("both ranks printing", lambda: "rank1 line 3" in job_logs(backend, job)
             and "rank0 line 3" in job_logs(backend, job) or backend.status(handle).state.terminal, 45)
    assert not backend.status(handle).state.terminal, job_logs(backend, job)[-3000:]
    assert ranks.exists()




def _assert_names_the_lost_node(status, backend, handle, job, lost: str, survivor: str,
                                killed_at: float) -> dict:
    text = job_logs(backend, job)
    print(status.message)  # what Airflow's task log shows (pytest -s)
    assert status.state is JobState.FAILED, (status, text[-3000:])
    assert status.failure is FailureKind.TRANSIENT, status
    assert f"node {lost} lost (" in status.message, (status.message, text[-3000:])
    assert f"node {survivor} lost" not in status.message, status.message
    event = {"status": "error", "message": status.message, "handle": handle,
             "result": status.result, "ended_at_epoch_s": status.ended_at_epoch_s}
    loss = event_disruption(event)
    assert loss is not None and loss["kind"] == NODE_LOSS and loss["node"] == lost, loss
    assert loss["survivors"] == [survivor], loss
    # Its last sign of life is after the job started and no later than the kill (+ clock
    # granularity); the report came after it.
    assert loss["lost_at"] <= killed_at + 1.5, (loss, killed_at)
    assert 0 <= loss["detection_s"] <= loss["detected_at"] - loss["lost_at"] + 0.01, loss
    # The train task's record of the failed try keeps it (trainforge.ledger.tries).
    assert try_ended(None, 1, None, event, time.time())["disruption"]["node"] == lost
    assert backend.status(handle).message == status.message  # decided once, polled the same
    return loss


def test_a_killed_agent_names_its_node_not_the_survivor(tmp_path, cluster):
    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job("agent")
    handle = backend.submit(job)
    _running_on_both(backend, handle, job, hosts)
    agents = hosts.processes(1, "torch.distributed.run")
    assert agents, job_logs(backend, job)[-3000:]
    for proc in [p for a in agents for p in a.children(recursive=True)] + agents:
        proc.kill()
    killed_at = time.time()
    status = wait_for("the job to end", lambda: (s := backend.status(handle)).state.terminal and s,
                      30, 0.25)
    loss = _assert_names_the_lost_node(status, backend, handle, job, hosts.name(1),
                                       hosts.name(0), killed_at)
    assert loss["source"].startswith("srun: its task 1"), loss
    assert loss["detection_s"] < 15, loss
    hosts.wait_nothing_left(WORDS)


def test_a_dead_host_is_named_from_slurms_node_state(tmp_path, cluster):
    hosts, slurm = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job("host")
    handle = backend.submit(job)
    _running_on_both(backend, handle, job, hosts)
    hosts.kill(1)  # slurmd, its step daemon, the agent and the rank: the machine is gone
    killed_at = time.time()
    status = wait_for("the job to end", lambda: (s := backend.status(handle)).state.terminal and s,
                      4 * SLURMD_TIMEOUT_S + 20, 0.5)
    loss = _assert_names_the_lost_node(status, backend, handle, job, hosts.name(1),
                                       hosts.name(0), killed_at)
    assert "Slurm" in loss["source"] or "controller" in loss["source"], loss
    hosts.wait_nothing_left(WORDS)
