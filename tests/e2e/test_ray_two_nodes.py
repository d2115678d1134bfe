"""The Ray engine on two Ray nodes: two test hosts (network namespaces of this machine,
tests/hosts.py), a Ray head on host 0 and a worker on host 1 (tests/ray_cluster.py), CPU only.

The demo pipeline on a tiny config with ``resources.nodes: 2`` (one rank per node, gloo) runs
through ``trainforge run`` (``airflow dags test``) on the submit host, with its MLflow server on
the submit host's bridge address so that rank 0 reaches it from either host. Then, on the same
cluster and through the backend: a two-node job cancelled while running leaves no process on
either host, a job asking for more nodes than the cluster has fails with what it asked for,
and a socket interface the nodes lack fails the job permanently at once, naming node and endpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.hosts import skip_if_unavailable, test_hosts
from tests.ray_cluster import ray_cluster

HERE = Path(__file__).resolve().parent
FAKES = HERE.parent / "operators" / "engines"  # fake_trainer.py

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.multihost]

# What runs a rank or its launcher: none of it may outlive a job.
JOB_PROCESS = re.compile(r"torchrun|torch\.distributed\.run|trainforge\.trainer\.train|"
                         r"fake_trainer|trainforge\.engines\.ray\.launcher")


@pytest.fixture(scope="module")
def cluster():
    skip_if_unavailable()
    # Short: Ray's socket paths under it must stay under 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="tf-ray2-"))
    with test_hosts(2) as hosts, ray_cluster(hosts, temp_dir, cpus_per_node=1) as ray:
        yield hosts, ray
    shutil.rmtree(temp_dir, ignore_errors=True)


def _job_processes(hosts) -> list[tuple[int, int, str]]:
    """(host, pid, command line) of every rank, torchrun or launcher on the hosts."""
    found = []
    for i in range(hosts.count):
        for pid in hosts.pids(i):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if JOB_PROCESS.search(cmdline):
                found.append((i, pid, cmdline[:200]))
    return found


def _nothing_running(ray) -> None:
    jobs = ray.state("jobs")
    assert jobs and all(j["status"] in ("SUCCEEDED", "FAILED", "STOPPED") for j in jobs), jobs
    tasks = [t for t in ray.state("tasks") if t["state"] not in ("FINISHED", "FAILED")]
    assert not tasks, tasks
    groups = [g for g in ray.state("placement_groups") if g["state"] != "REMOVED"]
    assert not groups, groups


@pytest.fixture(scope="module")
def two_node_run(cluster, tmp_path_factory, shakespeare_corpus):
    from trainforge.mlflow_setup import start_server

    hosts, ray = cluster
    home = tmp_path_factory.mktemp("trainforge-home-ray2")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    spec = yaml.safe_load((HERE / "tiny_shakespeare.yaml").read_text())
    spec["pipeline"]["name"] = "tiny_shakespeare_two_nodes"
    spec["registry"]["model_name"] = "tiny-shakespeare-two-nodes"
    training = spec["training"]
    training["engine"] = "ray"
    training["ray"] = {"address": ray.address}
    training["resources"] = {"nodes": 2, "processes_per_node": 1, "cpus_per_process": 1}
    training["optimization"].update(max_steps=20, warmup_steps=2)
    training["checkpoint"]["interval_steps"] = 10
    training["fault"]["startup_timeout"] = "2m"
    training["log_every_steps"] = 5
    spec["validation"].update(eval_tokens=2048, require_beats_unigram=False)
    spec_file = home / "tiny_two_nodes.yaml"
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    # On the bridge, not loopback: rank 0 logs to it from whichever host it runs on.
    with start_server(home / "mlflow", host=hosts.submit_address, port=0, timeout_s=120.0) as mlflow:
        env.update({"TRAINFORGE_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow.url})
        summary_path = home / "summary.json"
        started = time.monotonic()
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("trainforge")), "run", str(spec_file),
             "--summary-json", str(summary_path)],
            env=env, capture_output=True, text=True, timeout=900)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-6000:]
        from mlflow import MlflowClient

        versions = MlflowClient(mlflow.url).search_model_versions(
            "name = 'tiny-shakespeare-two-nodes'")
        yield {"home": home, "summary": json.loads(summary_path.read_text()), "output": output,
               "versions": versions, "wall_s": time.monotonic() - started}


@pytest.mark.airflow
def test_the_pipeline_succeeds_on_two_ray_nodes_and_registers_the_model(two_node_run):
    summary = two_node_run["summary"]
    assert summary["state"] == "success", summary
    assert {t: s["state"] for t, s in summary["stages"].items()} == {
        "prepare_data": "success", "train": "success",
        "validate_checkpoint": "success", "register_model": "success",
    }
    assert summary["steps_trained"] == 20
    assert summary["registered_model"] == "tiny-shakespeare-two-nodes"
    assert [v.version for v in two_node_run["versions"]] == [str(summary["model_version"])]


@pytest.mark.airflow
def test_the_trainer_ran_with_world_size_2_across_both_hosts(two_node_run, cluster):
    hosts, ray = cluster
    checkpoint = summary_checkpoint(two_node_run["summary"]["checkpoint"])
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["world_size"] == 2, meta
    task_log = next((two_node_run["home"] / "logs").iterdir()).read_text()
    # Each node's task says where it runs (Ray chooses which host gets bundle 0): one per host.
    nodes = dict(re.findall(r"trainforge: node (\d) of 2 on \S+ \((\S+)\): job folder", task_log))
    assert sorted(nodes.values()) == sorted(hosts.addresses), task_log[-4000:]
    assert f"c10d rendezvous on {nodes['0']}:" in task_log  # hosted by bundle 0's node
    assert "process group up: backend=gloo world_size=2" in task_log
    assert "step 20/20" in task_log and "TRAINFORGE_RESULT" in task_log
    # Node 1's console and its rank's own log stay in its job folder (on host 1's disk).
    (node1,) = ray.job_tmp_dir.glob("trainforge-*.node-1.*")
    console = (node1 / "ranks" / "node-1.log").read_text()
    assert console.strip(), "node 1's console is empty"
    assert list((node1 / "ranks").rglob("stdout.log")), list((node1 / "ranks").rglob("*"))


@pytest.mark.airflow
def test_nothing_is_left_running_after_the_run(two_node_run, cluster):
    hosts, ray = cluster
    _nothing_running(ray)
    assert not _job_processes(hosts)


def summary_checkpoint(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def _fake_job(key: str, fake: dict, nodes: int, startup_timeout_s: float = 120.0):
    from trainforge.engines.base import JobIdentity, TrainingJob

    return TrainingJob(identity=JobIdentity("two_nodes", key, "train", 1), config={"fake": fake},
                       module="fake_trainer", nodes=nodes, processes_per_node=1,
                       engine_options={"working_dir": str(FAKES)},
                       startup_timeout_s=startup_timeout_s)


def _wait(backend, handle, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = backend.status(handle)
        if status.state.terminal:
            return status
        time.sleep(0.5)
    raise AssertionError(f"Ray job {handle['submission_id']} did not end in {timeout_s} s")


def _both_ranks_printed(backend, handle, line: str, timeout_s: float = 120.0) -> None:
    """Wait until the job log shows ``line`` of the fake trainer from both ranks."""
    deadline, text = time.monotonic() + timeout_s, ""
    while not (f"rank0 {line}" in text and f"rank1 {line}" in text):
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.5)
        text = backend._client().get_job_logs(handle["submission_id"])


def test_cancelling_a_two_node_job_stops_torchrun_on_both_hosts(cluster):
    from trainforge.engines.base import JobState
    from trainforge.engines.ray.backend import RayBackend

    hosts, ray = cluster
    backend = RayBackend(address=ray.address)
    handle = backend.submit(_fake_job("r-cancel", {"lines": 1, "sleep_s": 300}, nodes=2))
    _both_ranks_printed(backend, handle, "line 0")
    members = _job_processes(hosts)
    assert {i for i, _, _ in members} == {0, 1}, members  # torchrun and a rank on each host
    assert backend.cancel(handle, grace_s=30).state is JobState.CANCELLED
    deadline = time.monotonic() + 30
    while _job_processes(hosts) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _job_processes(hosts), _job_processes(hosts)
    _nothing_running(ray)


def test_more_nodes_than_the_cluster_has_fails_with_what_was_asked(cluster):
    from trainforge.contract import FailureKind
    from trainforge.engines.base import JobState
    from trainforge.engines.ray.backend import RayBackend

    hosts, ray = cluster
    backend = RayBackend(address=ray.address)
    handle = backend.submit(_fake_job("r-three", {"lines": 1}, nodes=3, startup_timeout_s=5.0))
    status = _wait(backend, handle)
    assert status.state is JobState.FAILED and status.failure is FailureKind.TRANSIENT
    assert "could not be placed within the startup timeout (5 s)" in status.message
    assert "3 bundles of {'CPU': 1.0}, strategy STRICT_SPREAD" in status.message
    assert "the cluster has 2 alive nodes" in status.message, status.message
    assert "rank0 line" not in backend._client().get_job_logs(handle["submission_id"])
    _nothing_running(ray)
    assert not _job_processes(hosts)


def test_an_interface_the_nodes_lack_fails_permanently_at_once_naming_node_and_endpoint(cluster):
    from trainforge.contract import FailureKind
    from trainforge.engines.base import JobState
    from trainforge.engines.ray.backend import RayBackend

    hosts, ray = cluster
    backend = RayBackend(address=ray.address)
    job = _fake_job("r-ifname", {"lines": 1}, nodes=2, startup_timeout_s=60.0)
    job.engine_options["env_vars"] = {"GLOO_SOCKET_IFNAME": "eth9"}
    started = time.monotonic()
    handle = backend.submit(job)
    status = _wait(backend, handle)
    logs = backend._client().get_job_logs(handle["submission_id"])
    assert status.state is JobState.FAILED and status.failure is FailureKind.PERMANENT, \
        (status.message, logs[-3000:])
    assert time.monotonic() - started < 60, status  # at once, not at the startup timeout
    message = status.message
    assert re.search(r"preflight failed on node [01] of 2 on h[01] \(10\.[\d.]+\)", message), \
        message
    assert "GLOO_SOCKET_IFNAME=eth9 names eth9, which this node does not have" in message
    assert re.search(r"rendezvous 10\.[\d.]+:\d+; its own address 10\.[\d.]+ on eth0", message), \
        message
    assert "rank0 line" not in logs
    _nothing_running(ray)
    assert not _job_processes(hosts)


def test_a_lost_node_is_named_never_the_survivor(cluster):
    import psutil

    from trainforge.engines.base import JobState
    from trainforge.engines.ray.backend import RayBackend

    hosts, ray = cluster
    backend = RayBackend(address=ray.address)
    handle = backend.submit(_fake_job("r-lost", {"lines": 3000, "line_sleep_s": 0.2}, nodes=2))
    _both_ranks_printed(backend, handle, "line 3")
    # The second host's torchrun agent and its rank die, as when the machine's processes go
    # (whichever node of the job it runs: Ray places the bundles).
    agents = [psutil.Process(pid) for i, pid, cmd in _job_processes(hosts)
              if i == 1 and "torchrun" in cmd]
    assert agents, _job_processes(hosts)
    for proc in [p for a in agents for p in a.children(recursive=True)] + agents:
        proc.kill()
    status = _wait(backend, handle)
    print(status.message)
    lost, survivor = f"{hosts.name(1)} ({hosts.address(1)})", f"{hosts.name(0)} ("
    assert status.state is JobState.FAILED, status
    assert re.search(rf"node {re.escape(lost)} lost \(Ray: node [01] of 2: its torchrun agent "
                     r"was ended by SIGKILL", status.message), status.message
    assert f"node {survivor}" not in status.message, status.message
    loss = status.result["disruption"]
    assert loss["kind"] == "node_loss" and loss["node"] == lost, loss
    assert loss["survivors"] == [f"{hosts.name(0)} ({hosts.address(0)})"], loss
    assert 0 <= loss["detection_s"] < 10, loss
    deadline = time.monotonic() + 30
    while _job_processes(hosts) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _job_processes(hosts), _job_processes(hosts)
    _nothing_running(ray)


# On the ranks' path (a sitecustomize): the rank on host TF_TEST_RAISE_ON raises at its 5th
# optimizer step.
RAISE_ON_HOST = '''
import os
import socket
if os.environ.get("RANK") is not None and socket.gethostname() == os.environ.get("TF_TEST_RAISE_ON"):
    import torch
    _step, _calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == 5:
            raise ValueError("injected at optimizer step 5")
        return _step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
'''


def _trainer_job(tmp_path, key: str, max_restarts: int = 0, env: dict | None = None, **optim):
    from tests.trainer.conftest import build_dataset, make_job
    from trainforge.engines.base import JobIdentity, TrainingJob

    config = make_job(build_dataset(tmp_path / "data"), tmp_path / "checkpoints",
                      optim={"max_steps": 40, "warmup_steps": 2, **optim},
                      distributed={"backend": "gloo", "collective_timeout_s": 20})
    return TrainingJob(identity=JobIdentity("two_nodes", key, "train", 1), config=config,
                       module="trainforge.trainer.train", nodes=2, processes_per_node=1,
                       max_restarts=max_restarts, env={"HF_HUB_OFFLINE": "1", **(env or {})},
                       startup_timeout_s=120.0)


def test_a_rank_that_raises_on_the_second_node_is_named_with_its_host_and_line(cluster, tmp_path):
    from trainforge.engines.base import JobState
    from trainforge.engines.ray.backend import RayBackend

    hosts, ray = cluster
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(RAISE_ON_HOST)
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p)
    backend = RayBackend(address=ray.address)
    handle = backend.submit(_trainer_job(tmp_path, "r-raise", env={"PYTHONPATH": path,
                                                                   "TF_TEST_RAISE_ON": hosts.name(1)}))
    status = _wait(backend, handle, 240)
    logs = backend._client().get_job_logs(handle["submission_id"])
    assert status.state is JobState.FAILED, (status, logs[-3000:])
    assert re.search(rf"failed \(\S+, exit code \d+\): rank \d on {hosts.name(1)} \({re.escape(hosts.address(1))}\) "
                     r"raised ValueError during step 5: injected at optimizer step 5", status.message), status.message
    assert 'sitecustomize.py", line 11, in step' in status.message, status.message
    assert "collateral: rank " in status.message and f"on {hosts.name(0)} " in status.message, status.message
    [culprit] = status.result["root_cause"]["culprits"]
    assert culprit["host"] == hosts.name(1) and culprit["origin"] == "inject/sitecustomize.py:11 in step"
    assert "rank_records" not in status.result
    _nothing_running(ray)
    assert not _job_processes(hosts)


def test_a_bad_config_on_two_nodes_is_not_restarted_and_is_permanent(cluster, tmp_path):
    from trainforge.contract import FailureKind
    from trainforge.engines.base import JobState
    from trainforge.engines.ray.backend import RayBackend

    hosts, ray = cluster
    backend = RayBackend(address=ray.address)
    handle = backend.submit(_trainer_job(tmp_path, "r-78", max_restarts=2, global_batch_size=6, micro_batch_size=2))
    status = _wait(backend, handle, 240)
    logs = backend._client().get_job_logs(handle["submission_id"])
    assert status.state is JobState.FAILED and status.failure is FailureKind.PERMANENT, (status, logs[-3000:])
    assert status.result["status"] == "bad_config" and "global_batch_size" in status.message, status
    assert logs.count("process group up") == 1, logs[-3000:]  # rank 0's line: one attempt
    assert "stopping this node's torchrun agent" in logs and "exiting without training" not in logs, logs[-3000:]
    _nothing_running(ray)
    assert not _job_processes(hosts)


def test_a_rank_that_stops_on_the_second_node_is_named_not_the_one_that_timed_out(cluster, tmp_path):
    import signal

    import psutil

    from trainforge.engines.base import JobState
    from trainforge.engines.ray.backend import RayBackend

    hosts, ray = cluster
    backend = RayBackend(address=ray.address)
    job = _trainer_job(tmp_path, "r-stop", max_steps=400)
    job.config["distributed"]["collective_timeout_s"] = 8
    job.config["logging"]["log_every_steps"] = 1
    handle = backend.submit(job)
    deadline = time.monotonic() + 180
    while "step 3/400" not in backend._client().get_job_logs(handle["submission_id"]):
        assert time.monotonic() < deadline and not backend.status(handle).state.terminal, "no step 3"
        time.sleep(0.5)
    [rank] = [psutil.Process(pid) for i, pid, cmd in _job_processes(hosts)
              if i == 1 and "trainforge.trainer.train" in cmd and "torch.distributed.run" not in cmd]
    rank.send_signal(signal.SIGSTOP)  # alive and silent: the first node's rank times out waiting
    try:
        # once the first node's torchrun has ended (its rank recorded the wait), the stopped rank
        # is killed, as torchrun does after its grace period (a stopped process handles no SIGTERM)
        while not re.search(r"node \d failed \(", backend._client().get_job_logs(handle["submission_id"])):
            assert time.monotonic() < deadline, "the first node did not fail"
            time.sleep(0.5)
        rank.kill()
        status = _wait(backend, handle, 180)
    finally:
        if rank.is_running():
            rank.kill()  # our job's rank on our test host: the launcher's reap has normally done it
    assert status.state is JobState.FAILED, status
    assert re.search(rf"rank \d on {hosts.name(1)} \(\S+\) stopped making progress at step \d+: rank \d timed out "
                     r"or lost the connection waiting for it", status.message), status.message
    assert [c["host"] for c in status.result["root_cause"]["culprits"]] == [hosts.name(1)]
    _nothing_running(ray)
    assert not _job_processes(hosts)
