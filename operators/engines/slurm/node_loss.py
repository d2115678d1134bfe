"""Which node a Slurm job lost, and how long the engine took to say so.

A multi-node job's step ends at once when one node's srun task ends badly (``--kill-on-bad-exit``),
and the job fails; an elastic job goes on without it. The failure (or the elastic job's success)
names the lost node only on evidence that it was that node, never a node that merely failed:

1. Slurm says so: srun's ``srun: error: Node failure on <node>`` line in the job log (the
   controller told srun the node failed), or the node's state (``sinfo``): ``DOWN``, ``FAIL`` or
   not responding (the ``*`` suffix) -- the job's nodes are those the script's first line names;
2. else srun's **first** ``srun: error: <node>: task <n>: <how>`` line, when ``<how>`` is a
   signal (``Killed``, ``Terminated``, ...): the first node whose torchrun agent died, rather
   than exited with a code (``Exited with exit code N`` is a rank's or agent's failure, not a lost
   node: such a job's failure stays as it was). The lines after the first are the survivors,
   which srun killed.

The detection time: ``lost_at`` is the lost node's last sign of life that the job folder shows --
the newest of the last write to that node's console (``ranks/node-<N>.log``) and of its ranks'
records (``rank_records/``, which every training rank renews about once a second), else the job's
end (Slurm's ``End``, or the script's exit record); ``detected_at`` is when the
engine first reported the failure (the first :meth:`SlurmBackend.status` that saw it; kept in the
job folder's ``node_loss.json`` so later polls report the same). ``detection_s`` is the
difference: what passed between the node's last sign of life and the failure reaching Airflow.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainforge.engines.base import JobIdentity, TrainingJob
from trainforge.engines.jobfiles import read_json
from trainforge.storage.files import atomic_write_json
from trainforge.engines.slurm.script import LOG_NAME
from trainforge.errors import BackendError
from trainforge.trainer.causes import last_alive

log = logging.getLogger(__name__)

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
    """``node h1 lost (<how>; the failure was reported <d> s after its last sign of life)``;
    an elastic job's: ``...; its survivors noticed <d> s after ...``."""
    noticed = "its survivors noticed" if record.get("elastic") else "the failure was reported"
    return (f"node {record['node']} lost ({record['source']}; {noticed} "
            f"{record['detection_s']:.1f} s after its last sign of life)")


def survivors_noticed(job_dir: Path, after: float) -> float | None:
    """When an elastic job's survivors noticed a lost node: the first end, at or after
    ``after``, of a torchrun attempt that a later attempt followed (the last write to its ranks'
    consoles, ``ranks/<run>/attempt_<k>/<rank>/std*.log``: their collective failed there)."""
    ends = []
    for run in (job_dir / "ranks").glob("*/"):
        attempts = sorted(run.glob("attempt_*"), key=lambda p: int(p.name.rpartition("_")[2]))
        for attempt in attempts[:-1]:
            end = max((f.stat().st_mtime for f in attempt.glob("*/std*.log")), default=None)
            if end is not None and end >= after:
                ends.append(end)
    return min(ends) if ends else None


def job_node_loss(job_dir: Path, ended: float | None, exit_record: dict[str, Any] | None,
                  slurm: Any, elastic: bool = False) -> dict[str, Any] | None:
    """The failed job's lost node as the ledger's disruption record ``{"kind": "node_loss",
    "node", "source", "survivors", "lost_at", "detected_at", "detection_s"}``; None when nothing
    shows a node was lost. ``ended``: Slurm's end of the job; ``slurm``: the backend's
    `SlurmCommands`; ``elastic``: the job went on without the node, and the detection is when
    its survivors noticed (:func:`survivors_noticed`). Decided once, at the first poll that saw
    the job end, and kept in the job folder (:data:`RECORD_NAME`)."""
    saved = read_json(job_dir / RECORD_NAME)
    if saved is not None:
        return saved
    try:
        with open(job_dir / LOG_NAME, "rb") as fh:
            head = fh.read(65_536)
            fh.seek(0, os.SEEK_END)
            fh.seek(max(len(head), fh.tell() - 262_144))
            text = (head + b"\n" + fh.read()).decode(errors="replace")
    except OSError:
        return None
    nodes: list[str] = []
    states: dict[str, str] = {}
    nodelist = job_nodelist(text)
    if nodelist and ("," in nodelist or "[" in nodelist):  # else one node: no peer to lose
        try:
            nodes = slurm.run("scontrol", "show", "hostnames", nodelist).split()
            if len(nodes) > 1:
                for line in slurm.run("sinfo", "-h", "-N", "-n", nodelist,
                                      "-o", "%N|%T").splitlines():
                    name, _, node_state = line.strip().partition("|")
                    if name:
                        states[name] = node_state
        except BackendError as err:  # the log's evidence still counts
            log.warning("could not read the node states of Slurm job folder %s: %s", job_dir, err)
    if len(nodes) < 2:
        return None  # a one-node job's failure is the job's, not a lost peer's
    found = node_lost(text, states)
    if found is None or found[0] not in nodes:
        return None
    node, source = found
    detected = time.time()
    lost_at = float(ended or (exit_record or {}).get("ended_at") or detected)
    index = nodes.index(node)
    console = job_dir / "ranks" / f"node-{index}.log"  # the first node's console is the job log's
    signs = [console.stat().st_mtime] if index and console.exists() else []
    signs += [t for t in [last_alive(job_dir, node)] if t is not None]
    if signs:
        lost_at = min(lost_at, max(signs))
    lost_at = min(lost_at, detected)
    if elastic:
        detected = survivors_noticed(job_dir, lost_at) or detected
    record = {"kind": NODE_LOSS, "node": node, "source": source,
              "survivors": [n for n in nodes if n != node], "lost_at": round(lost_at, 3),
              "detected_at": round(detected, 3), "detection_s": round(detected - lost_at, 3),
              **({"elastic": True} if elastic else {})}
    atomic_write_json(job_dir / RECORD_NAME, record, sort_keys=True)
    return record


def elastic_node_loss(job_dir: Path, ended: float | None, exit_record: dict[str, Any] | None,
                      slurm: Any) -> dict[str, Any] | None:
    """The node a succeeded elastic job lost on its way (its survivors finished), else None."""
    if not (read_json(job_dir / "request.json") or {}).get("min_nodes"):
        return None  # a fixed-size job that succeeded lost nothing
    return job_node_loss(job_dir, ended, exit_record, slurm, elastic=True)


def lost_by_earlier_tries(job: TrainingJob, job_dir: Callable[[JobIdentity], Path]) -> tuple[str, ...]:
    """The node the latest earlier try of this task lost (its folder's :data:`RECORD_NAME`),
    when ``job`` is elastic: its retry runs without it, so the rendezvous moves to a surviving
    node (c10d's store lives on the first node). A fixed-size job keeps its nodes: Slurm
    chooses them. ``job_dir``: the backend's folder of an identity."""
    if not job.elastic:
        return ()
    for earlier in range(job.identity.try_number - 1, 0, -1):
        folder = job_dir(replace(job.identity, try_number=earlier))
        if folder.is_dir():
            loss = read_json(folder / RECORD_NAME) or {}
            return (str(loss["node"]),) if loss.get("node") else ()
    return ()
