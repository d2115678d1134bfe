"""The ray engine's node launcher (trainforge.engines.ray.launcher) without a cluster: its
command line, and its wait for the node tasks against a fake ``ray`` (which node's result and
exit code the job gets, the other nodes stopped when one fails). The launcher on real Ray nodes:
tests/e2e/test_ray_two_nodes.py. A node's preflight (run_node) on this machine's loopback."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from trainforge.engines.ray import launcher
from trainforge.engines.ray.render import parse_result


@pytest.mark.parametrize("argv,fragment", [
    (["--key", "k", "--nodes", "1", "--cpus-per-node", "1", "--", "torchrun"], "--nodes >= 2"),
    (["--key", "k", "--nodes", "2", "--cpus-per-node", "1"], "a torchrun command after --"),
])
def test_the_launcher_refuses_a_bad_command_line(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        launcher.parse_args(argv)
    assert fragment in capsys.readouterr().err


class _FakeRay:
    """What the launcher's wait loop uses of ``ray``. ``ends``: (node, outcome) in the order the
    node tasks end, an outcome being the task's value or the exception ``ray.get`` raises; a
    task cancelled before it ended ends cancelled."""

    def __init__(self, ends, on_their_own=()):
        self.order = [node for node, _ in ends]
        self.outcomes = dict(ends)
        self.cancelled = []
        self.on_their_own = set(on_their_own)  # nodes that end within the grace after a failure

    def wait(self, refs, num_returns=1, timeout=None):
        if timeout is not None:  # a timed wait: only those that end on their own, or once cancelled
            done = [r for r in refs if r in self.cancelled or r in self.on_their_own][:num_returns]
            return done, [r for r in refs if r not in done]
        first = min(refs, key=self.order.index)
        return [first], [r for r in refs if r != first]

    def get(self, ref):
        value = self.outcomes[ref]
        if isinstance(value, Exception):
            raise value
        return value

    def cancel(self, ref, force=False):
        self.cancelled.append(ref)
        self.outcomes[ref] = RuntimeError("TaskCancelledError: cancelled")


def _node(i, code, result=None):
    return i, {"node": i, "address": f"10.0.0.{i}", "exit_code": code, "result": result}


@pytest.mark.parametrize("ends,exit_code,result,cancelled", [
    ([_node(0, 0), _node(1, 0, {"status": "success"})], 0, {"status": "success"}, []),
    # rank 0 (on node 1 here: c10d orders ranks by address) failed permanently; node 0 is
    # stopped; torchrun's code is the job's, the result says permanent.
    ([_node(1, 1, {"status": "bad_config", "exit_code": 78}), _node(0, 0)], 1,
     {"status": "bad_config", "exit_code": 78}, [0]),
    # node 1's worker died: node 0 is stopped, the job fails naming node 1 (node_loss.py).
    ([(1, RuntimeError("NodeDiedError: node 10.0.0.1 died")), _node(0, 0)], 1, "node 1", [0]),
], ids=["success", "rank0-fails", "node-dies"])
def test_the_launcher_waits_for_every_node_and_stops_the_rest_on_a_failure(
        monkeypatch, capsys, ends, exit_code, result, cancelled):
    monkeypatch.setattr(launcher, "LOG_FLUSH_S", 0.0)
    fake = _FakeRay(ends)
    assert launcher._collect(fake, [0, 1], 2) == exit_code
    out = capsys.readouterr().out
    if result == "node 1":  # no result of its own, the lost node's record as the job's
        found = parse_result(out)
        assert found["status"] == "error" and found["exit_code"] == 1, found
        assert found["disruption"]["node"] == "node 1" and "NodeDiedError" in found["message"]
    else:
        assert parse_result(out) == result
    assert fake.cancelled == cancelled
    assert "node 0 of 2 ended" in out and "node 1 of 2 ended" in out, out
    if exit_code:
        assert "the other nodes have 5 s to end" in out and "stopping the other node" in out


def test_a_node_that_ends_on_its_own_after_a_peer_failed_keeps_its_result(monkeypatch, capsys):
    # A bad config on both nodes: node 1 (no result) ends first; node 0, rank 0's, ends within
    # the grace with the result that makes the failure permanent: not cancelled, not lost.
    monkeypatch.setattr(launcher, "LOG_FLUSH_S", 0.0)
    verdict = {"status": "bad_config", "exit_code": 78, "message": "optim.global_batch_size=6 ..."}
    fake = _FakeRay([_node(1, 1), _node(0, 1, verdict)], on_their_own={0})
    assert launcher._collect(fake, [0, 1], 2) == 1
    out = capsys.readouterr().out
    assert parse_result(out) == verdict and fake.cancelled == [], out
    assert "node 1 failed (torchrun exit code 1 on 10.0.0.1): the other nodes have 5 s to end" in out


def test_a_failed_preflight_is_the_jobs_result_when_the_other_node_is_cancelled_silently(
        monkeypatch, capsys):
    # Ray's TaskCancelledError may carry no message at all.
    monkeypatch.setattr(launcher, "LOG_FLUSH_S", 0.0)
    failed = {"status": "bad_config", "exit_code": 78, "message": "preflight failed on node 0"}
    fake = _FakeRay([_node(0, 78, failed), _node(1, 0)])
    cancel = fake.cancel
    fake.cancel = lambda ref, force=False: (cancel(ref), fake.outcomes.update({ref: KeyError()}))
    assert launcher._collect(fake, [0, 1], 2) == 78
    out = capsys.readouterr().out
    assert parse_result(out) == failed
    assert "node 1 of 2 ended: no exit code: KeyError: " in out, out


def _run_node(monkeypatch, tmp_path, node: int, endpoint: str, deadline_s: float,
              then: str = "true"):
    """run_node on this machine as Ray node ``node`` at 127.0.0.1, its "torchrun" a shell that
    prints its socket interface and arguments, then runs ``then``."""
    import ray.util

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(launcher.tempfile, "tempdir", str(tmp_path))
    argv = ["sh", "-c", f'echo "gloo=$GLOO_SOCKET_IFNAME nccl=$NCCL_SOCKET_IFNAME args=$*"; {then}',
            "sh",
            f"--rdzv-endpoint={launcher.RDZV_ENDPOINT}", f"--rdzv-conf=is_host={launcher.IS_HOST}"]
    return launcher.run_node(node, 2, "k", "{}", argv, endpoint, time.time() + deadline_s)


def test_a_node_that_cannot_reach_the_rendezvous_fails_permanently_before_torchrun(
        monkeypatch, tmp_path, capsys):
    with socket.socket() as held:  # bound, never listening: connections are refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        started = time.monotonic()
        info = _run_node(monkeypatch, tmp_path, 1, f"127.0.0.1:{port}", 1.5)
    assert 1.4 < time.monotonic() - started < 4
    assert info["exit_code"] == 78 and info["result"]["status"] == "bad_config", info
    message = info["result"]["message"]
    for fragment in ("preflight failed on node 1 of 2 on", "(127.0.0.1)",
                     f"rendezvous 127.0.0.1:{port}", "its own address 127.0.0.1 on lo"):
        assert fragment in message, (fragment, message)
    assert "gloo=" not in capsys.readouterr().out  # torchrun never started
    assert json.loads(Path(info["job_dir"], "result.json").read_text())["message"] == message


def test_a_node_runs_torchrun_with_the_interface_of_its_route_and_the_time_left(
        monkeypatch, tmp_path):
    info = _run_node(monkeypatch, tmp_path, 0, "127.0.0.1:29400", 30)  # node 0: it hosts the store
    assert info["exit_code"] == 0, info
    console = Path(info["job_dir"], "ranks", "node-0.log").read_text()
    # 30 s left, and 5 more on the store's host.
    assert re.search(r"gloo=lo nccl=lo args=--rdzv-endpoint=127\.0\.0\.1:29400 "
                     r"--rdzv-conf=join_timeout=3[45],is_host=true$", console, re.M), console


def test_a_rendezvous_timeout_after_the_preflight_is_named_as_such(monkeypatch, tmp_path):
    info = _run_node(monkeypatch, tmp_path, 0, "127.0.0.1:29400", 30,
                     then="echo torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError;"
                          " exit 1")
    assert info["exit_code"] == 1, info
    assert info["result"]["status"] == "error", info  # transient: a retry may find all nodes
    assert info["result"]["message"].startswith(
        "the rendezvous timed out on node 0 of 2 on "), info
    assert "at fault.startup_timeout (3" in info["result"]["message"], info
    other = _run_node(monkeypatch, tmp_path, 0, "127.0.0.1:29400", 30, then="exit 1")
    assert other["exit_code"] == 1 and other["result"] is None, other
