"""The ray engine's node launcher (trainforge.engines.ray.launcher) without a cluster: its
command line, and its wait for the node tasks against a fake ``ray`` (which node's result and
exit code the job gets, the other nodes stopped when one fails). The launcher on real Ray nodes:
tests/e2e/test_ray_two_nodes.py."""

from __future__ import annotations

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

    def __init__(self, ends):
        self.order = [node for node, _ in ends]
        self.outcomes = dict(ends)
        self.cancelled = []

    def wait(self, refs, num_returns=1, timeout=None):
        if timeout is not None:  # the grace wait after a cancel: all ended by then
            return list(refs), []
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
    # node 1's worker died: node 0 is stopped, the job fails without a result.
    ([(1, RuntimeError("NodeDiedError: node 10.0.0.1 died")), _node(0, 0)], 1, None, [0]),
], ids=["success", "rank0-fails", "node-dies"])
def test_the_launcher_waits_for_every_node_and_stops_the_rest_on_a_failure(
        monkeypatch, capsys, ends, exit_code, result, cancelled):
    monkeypatch.setattr(launcher, "LOG_FLUSH_S", 0.0)
    fake = _FakeRay(ends)
    assert launcher._collect(fake, [0, 1], 2) == exit_code
    out = capsys.readouterr().out
    assert parse_result(out) == result
    assert fake.cancelled == cancelled
    assert "node 0 of 2 ended" in out and "node 1 of 2 ended" in out, out
    if exit_code:
        assert "stopping the other nodes" in out
