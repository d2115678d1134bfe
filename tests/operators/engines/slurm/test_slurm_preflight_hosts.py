"""Each node's preflight on two real hosts (tests/hosts.py) under Slurm, with Debian-style hosts
files: each host's own name maps to ``127.0.1.1`` (the other's to its test address), where Gloo,
left to itself, advertises 127.0.1.1 to its peer and the job never starts.

* a two-node job trains: each node sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the
  interface of its route to the rendezvous (the hosts' ``eth0``);
* a socket interface that no node has (``GLOO_SOCKET_IFNAME=eth9``) fails the job permanently at
  once, naming the node, the rendezvous address and port and the node's own address;
* a named interface that is down on the hosts fails the job permanently in seconds, naming the
  node, the interface and the route's interface (``eth0``);
* the second host cannot reach the rendezvous port (its packets dropped): the job fails
  permanently within the startup timeout, with the same one-line message.

Nothing of a job is left running on either host after each.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from trainforge.contract import FailureKind
from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.slurm.backend import SlurmBackend
from tests.slurm_cluster import JOB_WORDS, job_logs, two_host_slurm
from tests.trainer.conftest import build_dataset, make_job

pytestmark = [pytest.mark.multihost, pytest.mark.integration, pytest.mark.distributed]

STARTUP_TIMEOUT_S = 20.0


def _debian_hosts(hosts) -> None:
    """Each host's hosts file maps its own name to 127.0.1.1, as Debian's installer writes it.
    The files are rewritten in place: the hosts' bind mounts see the change."""
    for i in range(hosts.count):
        lines = ["127.0.0.1 localhost", f"127.0.1.1 {hosts.name(i)}",
                 f"{hosts.submit_address} submit"]
        lines += [f"{hosts.address(j)} {hosts.name(j)}" for j in range(hosts.count) if j != i]
        hosts._hosts_file(i).write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def cluster():
    with two_host_slurm("tf-slurm-pf-", prepare=_debian_hosts) as (hosts, slurm):
        assert "127.0.1.1" in hosts.run(1, ["getent", "hosts", "h1"]).stdout
        yield hosts, slurm


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return build_dataset(tmp_path_factory.mktemp("data") / "tiny")


def _job(tmp_path: Path, dataset: Path, key: str, **options) -> TrainingJob:
    config = make_job(dataset, tmp_path / "checkpoints", optim={"max_steps": 4, "warmup_steps": 1},
                      logging={"log_every_steps": 1})
    return TrainingJob(identity=JobIdentity("preflight", key, "train", 1), config=config,
                       module="trainforge.trainer.train", nodes=2, processes_per_node=1,
                       engine_options={"python": sys.executable, **options},
                       max_runtime_s=600.0, startup_timeout_s=STARTUP_TIMEOUT_S)


def _wait_end(backend, handle, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = backend.status(handle)
        if status.state.terminal:
            return status
        time.sleep(0.25)
    raise AssertionError(f"job {handle} not ended after {timeout_s:.0f} s")








def test_a_two_node_job_trains_where_each_hosts_own_name_maps_to_127_0_1_1(
        tmp_path, cluster, dataset):
    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, "debian-hosts")
    status = _wait_end(backend, backend.submit(job), 300)
    text = job_logs(backend, job)
    assert status.state is JobState.SUCCEEDED, (status, text[-4000:])
    for i in range(2):
        assert (f"trainforge: node h{i} (node {i} of 2) reaches the rendezvous "
                f"{hosts.address(0)}:") in text, text[-4000:]
        assert (f"from its own address {hosts.address(i)} on eth0; set GLOO_SOCKET_IFNAME=eth0 "
                "NCCL_SOCKET_IFNAME=eth0") in text, text[-4000:]
    assert "process group up: backend=gloo world_size=2" in text
    assert "step 4/4 |" in text
    hosts.wait_nothing_left(JOB_WORDS)


def test_an_interface_no_node_has_fails_permanently_at_once_naming_node_and_address(
        tmp_path, cluster, dataset):
    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, "wrong-ifname", env_vars={"GLOO_SOCKET_IFNAME": "eth9"})
    started = time.monotonic()
    status = _wait_end(backend, backend.submit(job), 120)
    took = time.monotonic() - started
    text = job_logs(backend, job)
    assert status.state is JobState.FAILED, (status, text[-3000:])
    assert status.failure is FailureKind.PERMANENT, (status, text[-3000:])
    assert took < STARTUP_TIMEOUT_S, (took, status)
    assert "GLOO_SOCKET_IFNAME=eth9 names eth9, which this node does not have" in status.message
    assert "preflight failed on node h" in status.message, status.message
    assert f"rendezvous {hosts.address(0)}:" in status.message, status.message
    assert "its own address 10." in status.message and " on eth0" in status.message
    assert "torch.distributed.run" not in " ".join(hosts.leftovers(JOB_WORDS))
    hosts.wait_nothing_left(JOB_WORDS)


def test_a_named_interface_that_is_down_fails_permanently_in_seconds_naming_host_and_route(
        tmp_path, cluster, dataset):
    hosts, _ = cluster
    for i in range(hosts.count):  # a veth pair left down, in each host's own network namespace
        made = hosts.run(i, ["ip", "link", "add", "tfdown0", "type", "veth", "peer", "name", "tfdown1"])
        assert made.returncode == 0, made.stderr
    try:
        backend = SlurmBackend(tmp_path / "runs")
        job = _job(tmp_path, dataset, "down-ifname", env_vars={"GLOO_SOCKET_IFNAME": "tfdown0"})
        started = time.monotonic()
        status = _wait_end(backend, backend.submit(job), 120)
        took = time.monotonic() - started
    finally:
        for i in range(hosts.count):
            hosts.run(i, ["ip", "link", "del", "tfdown0"])
    assert status.state is JobState.FAILED and status.failure is FailureKind.PERMANENT, status
    assert took < STARTUP_TIMEOUT_S, (took, status)
    for fragment in ("preflight failed on node h", "GLOO_SOCKET_IFNAME=tfdown0",
                     "tfdown0 is administratively down", "the route to it leaves by eth0"):
        assert fragment in status.message, (fragment, status.message)
    hosts.wait_nothing_left(JOB_WORDS)


def test_an_unreachable_rendezvous_fails_permanently_within_the_startup_timeout(
        tmp_path, cluster, dataset):
    hosts, _ = cluster
    port = _free_port()
    # Host 1 drops its own packets to the rendezvous port (in its network namespace only).
    drop = ["OUTPUT", "-p", "tcp", "-d", hosts.address(0), "--dport", str(port), "-j", "DROP"]
    made = hosts.run(1, ["iptables", "-w", "-A", *drop])
    if made.returncode != 0:
        pytest.skip(f"needs iptables in a test host's network namespace (install iptables): "
                    f"{made.stderr.strip()}")
    try:
        backend = SlurmBackend(tmp_path / "runs")
        job = _job(tmp_path, dataset, "unreachable", rendezvous_port=port)
        handle = backend.submit(job)
        running = _wait_running(backend, handle)
        status = _wait_end(backend, handle, STARTUP_TIMEOUT_S + 60)
        took = time.monotonic() - running
    finally:
        hosts.run(1, ["iptables", "-w", "-D", *drop])
    text = job_logs(backend, job)
    assert status.state is JobState.FAILED, (status, text[-3000:])
    assert status.failure is FailureKind.PERMANENT, (status, text[-3000:])
    # Within the startup timeout of the job's start (and the poll and Slurm's teardown).
    assert took < STARTUP_TIMEOUT_S + 10, (took, status)
    message = status.message
    for fragment in ("preflight failed on node h1 (node 1 of 2) after ", "(fault.startup_timeout 20 s)",
                     f"rendezvous {hosts.address(0)}:{port}",
                     f"its own address {hosts.address(1)} on eth0",
                     "could not reach the rendezvous"):
        assert fragment in message, (fragment, message)
    hosts.wait_nothing_left(JOB_WORDS)


def _wait_running(backend, handle) -> float:
    deadline = time.monotonic() + 60
    while backend.status(handle).state is JobState.PENDING:
        assert time.monotonic() < deadline, "the job did not start in 60 s"
        time.sleep(0.1)
    return time.monotonic()


def _free_port() -> int:
    """A TCP port free here now; the hosts' network namespaces have their own, all free."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
