"""What `validate` says about a spec's network settings before anything launches: socket
interface variables in the syntax their backend reads, and NCCL only with GPUs."""

from __future__ import annotations

import pytest

from tests.operators.pipeline.test_loader import MINIMAL
from trainforge.pipeline import SpecError, parse_spec_text


def _spec(block: str) -> str:
    return MINIMAL.replace("training:\n", f"training:\n{block}", 1)


def _issue(text: str, path: str):
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "net.yaml")
    issues = [i for i in info.value.issues if i.path == path]
    assert issues, [str(i) for i in info.value.issues]
    return issues[0]


@pytest.mark.parametrize("engine", ["slurm", "ray"])
@pytest.mark.parametrize("name,value,fragment", [
    ("GLOO_SOCKET_IFNAME", "^lo,docker0", "'^' and '=' are NCCL's syntax, which Gloo does not read"),
    ("GLOO_SOCKET_IFNAME", "eth0,", "must be the names of network interfaces separated by ','"),
    ("GLOO_SOCKET_IFNAME", "an-interface-name-too-long", "e.g. 'eth0' or 'eth0,eth1'"),
    ("GLOO_SOCKET_IFNAME", "eth0 eth1", "got 'eth0 eth1'"),
    ("NCCL_SOCKET_IFNAME", "^^lo", "NCCL's interface list"),
    ("NCCL_SOCKET_IFNAME", "=", "NCCL's interface list"),
    ("NCCL_SOCKET_IFNAME", "eth0/1", "e.g. 'eth', '^docker0,lo' or '=ib0'"),
])
def test_a_socket_interface_the_backend_cannot_read_is_a_spec_error_at_its_line(
        engine, name, value, fragment):
    text = _spec(f"  engine: {engine}\n"
                 f"  {engine}:\n"
                 f"    env_vars:\n"
                 f"      {name}: '{value}'\n")
    issue = _issue(text, f"training.{engine}.env_vars.{name}")
    assert fragment in issue.message, issue.message
    assert repr(value) in issue.message or fragment.startswith("got")
    assert issue.line == 9, str(issue)  # the variable's own line


def test_every_bad_socket_interface_is_reported_at_once_each_at_its_line():
    text = _spec("  engine: slurm\n  slurm:\n    env_vars:\n      GLOO_SOCKET_IFNAME: 'eth0,=eth1'\n"
                 "      OMP_PROC_BIND: 'true'\n      NCCL_SOCKET_IFNAME: '^^lo'\n")
    gloo = _issue(text, "training.slurm.env_vars.GLOO_SOCKET_IFNAME")
    nccl = _issue(text, "training.slurm.env_vars.NCCL_SOCKET_IFNAME")
    assert (gloo.line, nccl.line) == (9, 11), (str(gloo), str(nccl))


@pytest.mark.parametrize("name,value", [
    ("GLOO_SOCKET_IFNAME", "eth0"), ("GLOO_SOCKET_IFNAME", "eth0,ib0"),
    ("GLOO_SOCKET_IFNAME", "enp3s0f1.100"), ("NCCL_SOCKET_IFNAME", "eth"),
    ("NCCL_SOCKET_IFNAME", "^docker0,lo"), ("NCCL_SOCKET_IFNAME", "=ib0"),
    ("NCCL_SOCKET_IFNAME", "^=docker0"),
])
def test_what_the_backends_accept_passes(name, value):
    spec = parse_spec_text(_spec(f"  engine: slurm\n  slurm:\n    env_vars:\n"
                                 f"      {name}: '{value}'\n"), "net.yaml")
    assert spec.training.engine_block.env_vars == {name: value}


def test_nccl_without_gpus_is_a_spec_error_naming_both_fields():
    text = _spec("  local:\n    distributed_backend: nccl\n")
    issue = _issue(text, "training.local.distributed_backend")
    assert "NCCL runs on GPUs only" in issue.message
    assert "resources.gpus_per_node 0" in issue.message and issue.line == 7, str(issue)


def test_nccl_with_gpus_and_gloo_without_pass():
    with_gpus = _spec("  resources: {gpus_per_node: 2, processes_per_node: 2}\n"
                      "  local:\n    distributed_backend: nccl\n")
    assert parse_spec_text(with_gpus, "net.yaml").training.resources.gpus_per_node == 2
    on_cpu = _spec("  local:\n    distributed_backend: gloo\n")
    assert parse_spec_text(on_cpu, "net.yaml").training.engine_block.distributed_backend == "gloo"


@pytest.mark.parametrize("name,value", [("GLOO_SOCKET_IFNAME", "lo"),
                                        ("NCCL_SOCKET_IFNAME", "lo"),
                                        ("NCCL_SOCKET_IFNAME", "=lo")])
def test_loopback_only_with_several_nodes_is_refused(name, value):
    text = _spec(f"  engine: slurm\n  resources: {{nodes: 2}}\n  slurm:\n    env_vars:\n"
                 f"      {name}: '{value}'\n")
    issue = _issue(text, "training.slurm.env_vars")
    assert "names only the loopback interface" in issue.message, issue.message
    assert "resources.nodes 2" in issue.message


@pytest.mark.parametrize("name,value,nodes", [("GLOO_SOCKET_IFNAME", "lo", 1),
                                              ("NCCL_SOCKET_IFNAME", "^lo", 2),
                                              ("GLOO_SOCKET_IFNAME", "lo,eth0", 2)])
def test_loopback_on_one_node_or_beside_another_interface_passes(name, value, nodes):
    spec = parse_spec_text(_spec(f"  engine: slurm\n  resources: {{nodes: {nodes}, processes_per_node: 1}}\n  slurm:\n"
                                 f"    env_vars:\n      {name}: '{value}'\n"), "net.yaml")
    assert spec.training.engine_block.env_vars[name] == value


def test_an_empty_gloo_interface_is_refused_without_the_nccl_hint():
    issue = _issue(_spec("  engine: slurm\n  slurm:\n    env_vars:\n      GLOO_SOCKET_IFNAME: ''\n"),
                   "training.slurm.env_vars.GLOO_SOCKET_IFNAME")
    assert "must be the names of network interfaces" in issue.message
    assert "NCCL's syntax" not in issue.message
