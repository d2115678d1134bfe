"""Which node a failed multi-node Ray job lost, from how its node tasks ended.

The launcher (:mod:`trainforge.engines.ray.launcher`) runs one Ray task per node, each running
that node's torchrun agent. A node is named lost only on evidence that it was that node, never a
survivor whose ranks merely noticed the loss (they exit with a code, like any rank failure):

1. its node task raised instead of returning (Ray lost the worker or the node: ``NodeDiedError``,
   ``WorkerCrashedError``, ...), unless the launcher itself had cancelled it (after another
   node failed: ``cancelled`` in its end);
2. else its torchrun agent was ended by a signal (a negative exit code: killed, as when the
   machine's processes go).

The first such node in the order the tasks ended is named. The record is the ledger's
disruption (trainforge.ledger.disruptions), as on Slurm (docs/ray.md, "Node loss").
"""

from __future__ import annotations

import signal
from typing import Any

NODE_LOSS = "node_loss"
_CANCELLED = "TaskCancelledError"


def _name(info: dict[str, Any]) -> str:
    """``host (address)`` of a node task's end, else ``node <i>``."""
    host, address = info.get("host"), info.get("address")
    if host and address:
        return f"{host} ({address})"
    return str(host or address or f"node {info.get('node')}")


def _how(info: dict[str, Any]) -> str | None:
    """How a node task's end shows its node was lost, or None."""
    if info.get("cancelled"):
        return None  # stopped by the launcher: whatever it ended with is not its own
    error = info.get("error")
    if error:
        return None if _CANCELLED in str(error) else f"its Ray task failed: {error}"
    code = info.get("exit_code")
    if isinstance(code, int) and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"its torchrun agent was ended by {name}"
    return None


def lost_node(ended: list[dict[str, Any]], nodes: int) -> dict[str, Any] | None:
    """The disruption record ``{"kind": "node_loss", "node", "source", "survivors", "lost_at",
    "detected_at", "detection_s"}`` of the first lost node among ``ended`` (node task ends in
    the order the launcher saw them, each with ``seen_at``, and ``ended_at`` when the task
    returned), or None. ``nodes``: the job's node count."""
    if nodes < 2:
        return None
    for info in ended:
        how = _how(info)
        if how is None:
            continue
        detected = float(info.get("seen_at") or 0.0)
        lost_at = min(float(info.get("ended_at") or detected), detected)
        return {"kind": NODE_LOSS, "node": _name(info), "node_index": info.get("node"),
                "source": f"Ray: node {info.get('node')} of {nodes}: {how}",
                "survivors": [_name(i) for i in sorted(ended, key=lambda i: i.get("node", 0))
                              if i is not info],
                "lost_at": round(lost_at, 3), "detected_at": round(detected, 3),
                "detection_s": round(detected - lost_at, 3)}
    return None


def describe(record: dict[str, Any]) -> str:
    """``node h1 (10.0.0.11) lost (<how>; the failure was reported <d> s after ...)``."""
    return (f"node {record['node']} lost ({record['source']}; the failure was reported "
            f"{record['detection_s']:.1f} s after its end)")
