"""``training.resources``: the size of the training job, and the rules an elastic size brings.

``nodes`` is a count of machines, or ``{min, max}`` for an elastic job (slurm engine): it starts
on up to ``max`` machines and goes on with at least ``min`` after losing one. Code that sizes or
bills the job reads :attr:`ResourcesSection.max_nodes`, never ``nodes`` itself.

The rules here read other sections (the fault policy, the batch sizes) and are called from
:meth:`trainforge.pipeline.spec.TrainingSection._rules`; each returns
:func:`~trainforge.sections.field_errors` entries ``(loc, message, value, related)``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator

from trainforge.sections import SpecModel, field_errors

MAX_NODES = 4096
_EXPECTED = "expected a node count or {min, max}"


class NodeRange(SpecModel):
    """An elastic job's size: it starts on up to ``max`` machines and keeps training while at
    least ``min`` remain."""

    min: int = Field(ge=1, le=MAX_NODES, description="Fewest machines the job goes on with.")
    max: int = Field(ge=1, le=MAX_NODES, description="Most machines the job starts on.")

    @model_validator(mode="after")
    def _ordered(self) -> NodeRange:
        if self.min > self.max:
            raise field_errors(NodeRange, (("max",), f"nodes.max must be at least nodes.min "
                               f"(got min {self.min}, max {self.max}; expected max {self.min} or "
                               f"more)", self.max, ()))
        return self

    def __str__(self) -> str:
        return f"{{min: {self.min}, max: {self.max}}}"


def _node_shape(value: Any) -> Any:
    """Refuse, in one line, what is neither a count nor a mapping (a boolean, text, a list):
    pydantic would read ``true`` as 1 and ``"2"`` as 2, or list both union members' errors."""
    if isinstance(value, (dict, NodeRange, float)) or type(value) is int:
        return value  # the int member says what is wrong with 0 or 2.5
    if isinstance(value, bool):
        raise ValueError(f"a boolean is not a node count (got {value}; {_EXPECTED})")
    if isinstance(value, str):
        hint = "; write the number without quotes" if value.strip().isdigit() else ""
        raise ValueError(f"wrong kind of value (got {value!r}; {_EXPECTED}{hint})")
    shown = "a list" if isinstance(value, list) else "null" if value is None else repr(value)
    raise ValueError(f"wrong kind of value (got {shown}; {_EXPECTED})")


def _member(value: Any) -> str:
    """The union member that validates ``value``: a mapping is a range, anything else a count."""
    return "NodeRange" if isinstance(value, (dict, NodeRange)) else "int"


#: ``resources.nodes``: a count, or a range. The tags name the member as messages.py expects.
Nodes = Annotated[
    Union[Annotated[Annotated[int, Field(ge=1, le=MAX_NODES)], Tag("int")],  # noqa: UP007
          Annotated[NodeRange, Tag("NodeRange")]],
    Discriminator(_member), BeforeValidator(_node_shape),
]


class ResourcesSection(SpecModel):
    """The training job's size: machines, ranks per machine, GPUs, CPUs, memory, image."""

    nodes: Nodes = Field(
        1, description="Machines in the training job: a count, or {min, max} for an elastic job "
        "that starts on up to max and goes on with at least min after losing a node (slurm "
        f"engine). Each 1 to {MAX_NODES}."
    )
    processes_per_node: int = Field(
        2, ge=1, le=64, description="Ranks per machine (torchrun --nproc-per-node); one per GPU "
        "when gpus_per_node is set."
    )
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs requested per machine.")
    cpus_per_process: int = Field(
        1, ge=1, le=256, description="CPU cores per rank; also its OMP_NUM_THREADS."
    )
    memory_gib: float | None = Field(None, gt=0, le=1_048_576,
                                     description="Memory per machine, GiB.")
    image: str | None = Field(None, description="Container image of the trainer (cluster engines).")

    @model_validator(mode="after")
    def _gpus(self) -> ResourcesSection:
        if self.gpus_per_node and self.processes_per_node != self.gpus_per_node:
            raise field_errors(ResourcesSection, (
                ("processes_per_node",), f"processes_per_node must equal gpus_per_node when GPUs "
                f"are requested, one rank per GPU (got {self.processes_per_node} and "
                f"{self.gpus_per_node})", self.processes_per_node, ("gpus_per_node",)))
        return self

    @property
    def max_nodes(self) -> int:
        """The most machines the job runs on: what it is sized and billed for."""
        return self.nodes.max if isinstance(self.nodes, NodeRange) else self.nodes

    @property
    def min_nodes(self) -> int:
        """The fewest machines the job goes on with (``max_nodes`` unless elastic)."""
        return self.nodes.min if isinstance(self.nodes, NodeRange) else self.nodes

    @property
    def elastic(self) -> bool:
        """The job may go on with fewer machines than it started on (``{min: 2, max: 2}`` is
        not elastic: exactly 2)."""
        return self.min_nodes < self.max_nodes


def elastic_fault_errors(resources: ResourcesSection, fault: Any) -> list[tuple]:
    """What an elastic job asks of ``training.fault``: torchrun goes on without a lost node by
    restarting the worker group on the survivors (one restart), on a smaller world size."""
    if not resources.elastic:
        return []
    errors = []
    if fault.max_restarts < 1:
        errors.append((("fault", "max_restarts"), f"an elastic job goes on after losing a node "
                       f"by restarting torchrun's worker group, which spends one restart (got "
                       f"fault.max_restarts {fault.max_restarts} with resources.nodes "
                       f"{resources.nodes}; expected 1 or more, or a node count)",
                       fault.max_restarts, ("resources", "nodes")))
    if fault.world_size_change == "refuse":
        errors.append((("fault", "world_size_change"), f"losing a node changes the world size, "
                       f"which fault.world_size_change 'refuse' forbids (got 'refuse' with "
                       f"resources.nodes {resources.nodes}; expected 'continue', or a node "
                       f"count)", fault.world_size_change, ("resources", "nodes")))
    return errors


def batch_errors(optimization: Any, resources: ResourcesSection) -> list[tuple]:
    """``global_batch_size`` must split into whole micro-batches over every rank, at every node
    count the job may run on (the trainer keeps the global batch by gradient accumulation)."""
    glob, micro, ppn = (optimization.global_batch_size, optimization.micro_batch_size,
                        resources.processes_per_node)
    loc = ("optimization", "global_batch_size")
    if not resources.elastic:
        per_step = micro * resources.max_nodes * ppn
        if glob % per_step == 0:
            return []
        return [(loc, f"global_batch_size must be divisible by micro_batch_size x world size "
                 f"(got {glob}; {micro} x {resources.max_nodes * ppn} = {per_step})", glob, ())]
    counts = range(resources.min_nodes, resources.max_nodes + 1)
    failing = [n for n in counts if glob % (micro * n * ppn)]
    if not failing:
        return []
    first, working = failing[0], [n for n in counts if n not in failing]
    shown = f"{micro} x {first * ppn} = {micro * first * ppn} at {first} nodes"
    if len(failing) > 1:
        shown += f", and at {_listed(failing[1:])} nodes"
    multiple = micro * ppn * math.lcm(*counts)
    remedy = (f"a multiple of {multiple}" if multiple < 10**12 else
              "a multiple of micro_batch_size x processes_per_node x each count")
    if working:
        remedy += f", or resources.nodes {_longest_run(working)}"
    return [(loc, f"global_batch_size must be divisible by micro_batch_size x world size at "
             f"every node count of resources.nodes {resources.nodes}, the trainer keeping it by "
             f"gradient accumulation (got {glob}; {shown}; expected {remedy})", glob, ())]


def _longest_run(counts: list[int]) -> str:
    """The longest run of consecutive counts as a node setting (``{min: 2, max: 4}``, or ``4``);
    of equal runs, the one with the most nodes."""
    runs: list[list[int]] = []
    for n in counts:
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    run = max(runs, key=lambda r: (len(r), r[-1]))
    return str(run[0]) if len(run) == 1 else str(NodeRange(min=run[0], max=run[-1]))


def _listed(counts: list[int]) -> str:
    """``1, 2 and 4``; a long list is cut after six (``..., and 120 more``)."""
    shown = [str(n) for n in counts[:6]]
    if len(counts) > 6:
        return ", ".join(shown) + f" and {len(counts) - 6} more"
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
