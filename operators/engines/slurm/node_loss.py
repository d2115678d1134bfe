"""Which node a failed Slurm job lost, and how long the engine took to say so.

A multi-node job's step ends at once when one node's srun task ends badly (``--kill-on-bad-exit``),
and the job fails. The failure names the lost node only on evidence that it was that node, never
the first node that merely failed:

1. Slurm says so: srun's ``srun: error: Node failure on <node>`` line in the job log (the
   controller told srun the node failed), or the node's state (``sinfo``): ``DOWN``, ``FAIL`` or
   not responding (the ``*`` suffix) -- the job's nodes are those the script's first line names;
2. else srun's **first** ``srun: error: <node>: task <n>: <how>`` line, when ``<how>`` is a
   signal (``Killed``, ``Terminated``, ...): the first node whose torchrun agent died, rather
   than exited with a code (``Exited with exit code N`` is a rank's or agent's failure, not a lost
   node: such a job's failure stays as it was). The lines after the first are the survivors,
   which srun killed.

The detection time: ``lost_at`` is the lost node's last sign of life that the job folder shows --
the last write to that node's console (``ranks/node-<N>.log``, its ranks print every logged step),
else the job's end (Slurm's ``End``, or the script's exit record); ``detected_at`` is when the
engine first reported the failure (the first :meth:`SlurmBackend.status` that saw it; kept in the
job folder's ``node_loss.json`` so later polls report the same). ``detection_s`` is the
difference: what passed between the node's last sign of life and the failure reaching Airflow.
"""

from __future__ import annotations

import re
from typing import Any

NODE_LOSS = "node_loss"
"""The disruption kind (trainforge.ledger.disruptions)."""
RECORD_NAME = "node_loss.json"

_NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")
_TASK_END = re.compile(r"srun: error: ([^\s:]+): tasks? ([\d,\-]+): (.+?)\s*$", re.M)
_JOB_NODES = re.compile(r"trainforge: Slurm job \d+ on (\S+);")
_SIGNALLED = ("killed", "terminated", "aborted", "segmentation fault", "bus error", "hangup")


def srun_tasks(log_text: str) -> list[tuple[str, str, str]]:
    """``(node, tasks, how)`` of srun's task-end error lines, in the order srun printed them."""
    return [(m[1], m[2], m[3]) for m in _TASK_END.finditer(log_text)]


def job_nodelist(log_text: str) -> str | None:
    """The job's node list as the script's first line printed it (``h[0-1]``), if it did."""
    found = _JOB_NODES.findall(log_text)
    return found[-1] if found else None


def node_lost(log_text: str, node_states: dict[str, str]) -> tuple[str, str] | None:
    """``(node, how we know)`` of the lost node (module docstring), or None when nothing shows
    that a node was lost. ``node_states``: the job's nodes' ``sinfo`` states (``idle``,
    ``down*``, ...)."""
    failed = _NODE_FAILURE.findall(log_text)
    if failed:
        return failed[0], "srun: the controller reported a node failure"
    for node, state in node_states.items():
        s = state.lower()
        if s.endswith("*") or s.startswith(("down", "fail")):
            return node, f"Slurm's node state is {state}"
    tasks = srun_tasks(log_text)
    if tasks:
        node, task, how = tasks[0]
        if how.lower().startswith(_SIGNALLED):
            return node, f"srun: its task {task} was the first to end: {how}"
    return None


def describe(record: dict[str, Any]) -> str:
    """``node h1 lost (<how>; last sign of life <t>, reported <d> s later)``."""
    return (f"node {record['node']} lost ({record['source']}; the failure was reported "
            f"{record['detection_s']:.1f} s after its last sign of life)")
