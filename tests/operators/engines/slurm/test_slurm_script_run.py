"""The rendered sbatch script run by bash, with stand-ins for Slurm's ``scontrol`` and ``srun``
and for the nodes' Python: what it does about the multi-node failures seen in the field, without
a cluster (the real two-node run is in test_slurm_pipeline.py).

The stand-ins: ``scontrol`` answers ``show hostnames`` and ``show node -o`` from ``FAKE_NODES``
and ``FAKE_ADDR_<node>``; ``srun`` runs its command once per node in turn, with the
``SLURMD_NODENAME`` and ``SLURM_NODEID`` Slurm gives each task; the nodes' "python" runs the real
interpreter for ``-c`` (the script's port checks) and, as torchrun, prints where it would meet.
Name resolution is the machine's own (``getent``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainforge.engines.base import JobIdentity, TrainingJob
from trainforge.engines.slurm.script import render_script

SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' $FAKE_NODES; exit 0; fi
if [ "$1 $2 $3" = "show node -o" ]; then
  echo "NodeName=$4 Arch=x86_64 NodeAddr=$(printenv "FAKE_ADDR_$4") NodeHostName=$4 State=ALLOCATED"
  exit 0
fi
exit 1
"""
SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
i=0; rc=0
for node in $FAKE_NODES; do
  SLURMD_NODENAME=$node SLURM_NODEID=$i "$@"; r=$?; [ "$r" -gt "$rc" ] && rc=$r; i=$((i + 1))
done
exit $rc
"""
PYTHON = """#!/bin/bash
if [ "$1" = -c ]; then exec {python} "$@"; fi
if [ "$2" = trainforge.engines.node_preflight ] && [ -n "${{REAL_PREFLIGHT:-}}" ]; then
  exec {python} "$@"
fi
echo "torchrun on $SLURMD_NODENAME local_addr=$PET_LOCAL_ADDR \
gloo=${{GLOO_SOCKET_IFNAME:-}} nccl=${{NCCL_SOCKET_IFNAME:-}} args: $*"
if [ -n "${{FAKE_FAILURE:-}}" ]; then echo "$FAKE_FAILURE"; exit 1; fi
"""


def _job(nodes: int, port: int | None = None) -> TrainingJob:
    return TrainingJob(
        identity=JobIdentity("two_nodes", "manual__1", "train", 1),
        config={"format": "trainforge.job/v1"}, nodes=nodes, processes_per_node=1,
        engine_options={"python": "python-on-nodes", "rendezvous_port": port},
        max_runtime_s=600.0, startup_timeout_s=300.0,
    )


def _run(tmp_path: Path, nodes: dict[str, str], port: int | None = None,
         job_id: int = 7, **extra_env: str) -> tuple[int, str, Path]:
    """Run the script of a job on ``nodes`` (name -> NodeAddr): (exit code, console, job dir)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN),
                       ("python-on-nodes", PYTHON.format(python=sys.executable))):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    job_dir = tmp_path / "job"
    (job_dir / "ranks").mkdir(parents=True, exist_ok=True)
    script = job_dir / "job.sbatch"
    script.write_text(render_script(_job(len(nodes), port), job_dir))
    env = {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "FAKE_NODES": " ".join(nodes),
           "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_NNODES": str(len(nodes)),
           "SLURM_JOB_ID": str(job_id), "SLURM_CPUS_PER_TASK": "1",
           **{f"FAKE_ADDR_{name}": addr for name, addr in nodes.items()}, **extra_env}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, proc.stdout + proc.stderr, job_dir


def _exit_record(job_dir: Path) -> int:
    return json.loads((job_dir / "exit.json").read_text())["exit_code"]


def test_every_node_meets_at_the_first_nodes_address_and_names_itself_by_its_own(tmp_path):
    rc, out, job_dir = _run(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11"})
    assert rc == 0 and _exit_record(job_dir) == 0, out
    assert "rendezvous 192.0.2.10:29507" in out
    assert "torchrun on n0 local_addr=192.0.2.10 " in out
    # Each node's preflight comes first, with the job's startup timeout, then execs torchrun.
    assert ("args: -m trainforge.engines.node_preflight --timeout=300 -- python-on-nodes -m "
            "torch.distributed.run") in out
    assert "--rdzv-endpoint=192.0.2.10:29507" in out and "join_timeout=300" in out
    second = (job_dir / "ranks" / "node-1.log").read_text()
    assert "torchrun on n1 local_addr=192.0.2.11 " in second
    assert "--rdzv-endpoint=192.0.2.10:29507" in second


def test_only_the_first_node_is_told_it_hosts_the_store(tmp_path):
    # torch would otherwise decide from its host name, which on Debian-style hosts files maps
    # to 127.0.1.1 and matches no address of the endpoint (pytorch #79388).
    rc, out, job_dir = _run(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11"})
    assert rc == 0, out
    assert "--rdzv-conf=join_timeout=300,is_host=true" in out
    second = (job_dir / "ranks" / "node-1.log").read_text()
    assert "--rdzv-conf=join_timeout=300,is_host=false" in second
    assert "@TRAINFORGE_IS_HOST@" not in out + second


def test_an_ipv6_first_node_is_written_in_brackets(tmp_path):
    rc, out, job_dir = _run(tmp_path, {"n0": "::1"})  # a one-node job: loopback is fine
    assert rc == 0, out
    assert "rendezvous [::1]:29507" in out and "--rdzv-endpoint=[::1]:29507" in out, out


def test_a_first_node_address_that_does_not_resolve_is_a_configuration_error(tmp_path):
    rc, out, job_dir = _run(tmp_path, {"gpu-a17": "gpu-a17.invalid", "gpu-a18": "192.0.2.11"})
    assert rc == 78 and _exit_record(job_dir) == 78, out
    assert ("the first node gpu-a17 has the address gpu-a17.invalid, which does not resolve"
            in out), out
    assert "torchrun on" not in out


def test_a_loopback_rendezvous_address_is_refused_with_several_nodes(tmp_path):
    rc, out, job_dir = _run(tmp_path, {"n0": "127.0.0.1", "n1": "192.0.2.11"})
    assert rc == 78 and _exit_record(job_dir) == 78, out
    assert "a loopback address the other 1 node(s) cannot reach" in out
    assert "torchrun on" not in out


def test_a_loopback_address_is_fine_on_one_node(tmp_path):
    rc, out, job_dir = _run(tmp_path, {"localhost": "127.0.0.1"})
    assert rc == 0 and "rendezvous 127.0.0.1:29507" in out, out


def _busy(port: int) -> socket.socket:
    sock = socket.socket()
    try:
        sock.bind(("", port))
    except OSError:
        sock.close()
        pytest.skip(f"port {port} is already taken on this machine by something else")
    sock.listen()
    return sock


def test_a_taken_default_port_moves_the_rendezvous_to_a_free_one(tmp_path):
    job_id = 4000 + os.getpid() % 5000
    port = 29500 + job_id % 10000
    with _busy(port):
        rc, out, _ = _run(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11"}, job_id=job_id)
    assert rc == 0, out
    moved = [line for line in out.splitlines() if "is in use on n0" in line]
    assert moved and moved[0].startswith(f"trainforge: port {port} is in use on n0; "
                                         "the rendezvous takes the free port "), out
    free = int(moved[0].rsplit(" ", 1)[1])
    assert free != port and f"--rdzv-endpoint=192.0.2.10:{free}" in out


def test_a_taken_fixed_port_fails_naming_the_node_and_the_setting(tmp_path):
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    with _busy(port):
        rc, out, job_dir = _run(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11"}, port=port)
    assert rc == 1 and _exit_record(job_dir) == 1, out
    assert (f"the rendezvous port {port} (training.slurm.rendezvous_port) is in use on the first "
            "node n0") in out


def test_the_preflight_sets_the_interface_of_the_route_to_the_rendezvous(tmp_path):
    rc, out, job_dir = _run(tmp_path, {"localhost": "127.0.0.1"}, REAL_PREFLIGHT="1")
    assert rc == 0 and _exit_record(job_dir) == 0, out
    assert "trainforge: node localhost (node 0 of 1) reaches the rendezvous 127.0.0.1:29507" in out
    assert "torchrun on localhost local_addr=127.0.0.1 gloo=lo nccl=lo " in out, out
    # What is left of the startup timeout, and a few seconds more on the store's host.
    assert "--rdzv-conf=join_timeout=305,is_host=true" in out or \
        "--rdzv-conf=join_timeout=304,is_host=true" in out, out


def test_a_first_node_that_cannot_host_its_address_fails_permanently_naming_it(tmp_path):
    # TEST-NET-3, no address of this machine: binding it fails, and nothing is sent to it.
    rc, out, job_dir = _run(tmp_path, {"n0": "203.0.113.10"}, REAL_PREFLIGHT="1")
    assert rc == 78 and _exit_record(job_dir) == 78, out
    assert "preflight failed on node n0 (node 0 of 1) after " in out, out  # seconds, not the timeout
    assert "(fault.startup_timeout 300 s)" in out, out
    assert "rendezvous 203.0.113.10:29507" in out and "torchrun on" not in out, out
    result = json.loads((job_dir / "result.json").read_text())
    assert result["status"] == "bad_config" and "203.0.113.10:29507" in result["message"]


@pytest.mark.parametrize("failure, named", [
    ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", True),
    ("RuntimeError: something else", False),
])
def test_a_rendezvous_timeout_after_the_preflight_is_named_as_such(tmp_path, failure, named):
    rc, out, job_dir = _run(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11"},
                            FAKE_FAILURE=failure)
    assert rc == 1 and _exit_record(job_dir) == 1, out
    result = job_dir / "result.json"
    if named:
        record = json.loads(result.read_text())
        assert record["status"] == "error" and record["exit_code"] == 1, record  # transient
        assert record["message"].startswith("the rendezvous timed out at fault.startup_timeout "
                                            "(300 s): every node reached the store"), record
    else:
        assert not result.exists(), result.read_text()
