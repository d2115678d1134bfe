"""The pipeline's task graph: every task id, its kind and its edges, written once.

One spec gives these tasks, in this order::

    prepare_data >> train >> validate_checkpoint >> register_model      (+ close_run teardown)

With ``stages`` (operators/pipeline/stages.py, docs/stages.md) there is one training task per
stage, ``train_<name>``, wired by ``depends_on``: the stages without dependencies follow
``prepare_data``, and the leaves (stages no other stage depends on) all feed
``validate_checkpoint``. With ``registry.approval`` (docs/registry.md) ``approve_champion``
follows ``register_model``: a person approves the gate's pass before ``champion`` moves.
``close_run`` (the teardown, trainforge.tasks.close_run) follows every other task.

The DAG builder, ``trainforge render``, the runner's summary and the teardown all read the graph
from :func:`task_graph`. Pure: pydantic models in, frozen dataclasses out; no Airflow import.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from trainforge.pipeline.stages import leaf_stages, resolve_stages


class TaskKind(str, enum.Enum):
    """What a task does; also its key under the spec's ``pipeline.tasks`` settings."""

    PREPARE_DATA = "prepare_data"
    TRAIN = "train"
    VALIDATE_CHECKPOINT = "validate_checkpoint"
    REGISTER_MODEL = "register_model"
    APPROVE_CHAMPION = "approve_champion"
    CLOSE_RUN = "close_run"


#: A training task's ``execution_timeout`` unless ``pipeline.tasks.train`` sets one: its
#: ``training.fault.run_timeout`` plus this margin (submission, the checkpoint check, cancel).
TRAIN_TIMEOUT_MARGIN_S = 600

PREPARE_DATA_TASK_ID = TaskKind.PREPARE_DATA.value
VALIDATE_CHECKPOINT_TASK_ID = TaskKind.VALIDATE_CHECKPOINT.value
REGISTER_MODEL_TASK_ID = TaskKind.REGISTER_MODEL.value
APPROVE_CHAMPION_TASK_ID = TaskKind.APPROVE_CHAMPION.value
CLOSE_RUN_TASK_ID = TaskKind.CLOSE_RUN.value


@dataclass(frozen=True)
class TaskNode:
    """One task of the graph.

    Attributes:
        task_id: the Airflow task id.
        kind: what the task does (the operator that runs it).
        upstream: task ids this task waits for, in wiring order.
        stage: the spec stage a training task trains (``stages[].name``); None for the
            single-stage ``train`` task and for every other kind.
        is_teardown: an Airflow teardown task: runs once its upstream tasks are done, whatever
            their states, and never decides the DAG run's state.
    """

    task_id: str
    kind: TaskKind
    upstream: tuple[str, ...] = ()
    stage: str | None = None
    is_teardown: bool = False


@dataclass(frozen=True)
class TaskGraph:
    """The tasks of one pipeline, upstream tasks before their downstream tasks."""

    nodes: tuple[TaskNode, ...]

    @property
    def task_ids(self) -> list[str]:
        return [node.task_id for node in self.nodes]

    def node(self, task_id: str) -> TaskNode:
        """The node of ``task_id``.

        Raises:
            KeyError: the graph has no such task.
        """
        for node in self.nodes:
            if node.task_id == task_id:
                return node
        raise KeyError(f"no task {task_id!r} in the pipeline (tasks: {', '.join(self.task_ids)})")

    def of_kind(self, kind: TaskKind) -> list[TaskNode]:
        """The nodes of ``kind``, in graph order."""
        return [node for node in self.nodes if node.kind is kind]

    @property
    def train_nodes(self) -> list[TaskNode]:
        """The training tasks, dependencies before dependants."""
        return self.of_kind(TaskKind.TRAIN)

    @property
    def teardown(self) -> TaskNode:
        """The pipeline's teardown task (``close_run``)."""
        return next(node for node in self.nodes if node.is_teardown)

    @property
    def teardown_ids(self) -> frozenset[str]:
        return frozenset(node.task_id for node in self.nodes if node.is_teardown)

    def edges(self) -> list[list[str]]:
        """The dependencies as ``[upstream, downstream]`` task id pairs, in graph order."""
        return [[up, node.task_id] for node in self.nodes for up in node.upstream]


def task_graph(spec) -> TaskGraph:
    """The task graph of a validated ``PipelineSpec`` (module docstring)."""
    stages = resolve_stages(spec)
    by_name = {stage.name: stage.task_id for stage in stages}
    nodes = [TaskNode(PREPARE_DATA_TASK_ID, TaskKind.PREPARE_DATA)]
    nodes += [
        TaskNode(stage.task_id, TaskKind.TRAIN,
                 tuple(by_name[name] for name in stage.depends_on) or (PREPARE_DATA_TASK_ID,),
                 stage=stage.name)
        for stage in stages
    ]
    nodes.append(TaskNode(VALIDATE_CHECKPOINT_TASK_ID, TaskKind.VALIDATE_CHECKPOINT,
                          tuple(leaf.task_id for leaf in leaf_stages(stages))))
    nodes.append(TaskNode(REGISTER_MODEL_TASK_ID, TaskKind.REGISTER_MODEL,
                          (VALIDATE_CHECKPOINT_TASK_ID,)))
    if spec.registry.approval is not None:
        nodes.append(TaskNode(APPROVE_CHAMPION_TASK_ID, TaskKind.APPROVE_CHAMPION,
                              (REGISTER_MODEL_TASK_ID,)))
    nodes.append(TaskNode(CLOSE_RUN_TASK_ID, TaskKind.CLOSE_RUN,
                          tuple(node.task_id for node in nodes), is_teardown=True))
    return TaskGraph(tuple(nodes))


@dataclass(frozen=True)
class TaskTimeout:
    """How long one task may run, and where it waits.

    Attributes:
        task_id: the Airflow task id.
        kind: what the task does.
        seconds: its Airflow ``execution_timeout``; None: none.
        keys: the spec field that sets it, as keys from the document's root.
        in_worker: the task holds its worker slot for its whole run; False for a task that
            defers its wait to the triggerer (a deferrable training task, the approval).
    """

    task_id: str
    kind: TaskKind
    seconds: int | None
    keys: tuple[str | int, ...]
    in_worker: bool

    @property
    def field(self) -> str:
        """:attr:`keys` as a dotted path (``stages.1.training.fault.run_timeout``)."""
        return ".".join(map(str, self.keys))


def task_timeouts(spec, graph: TaskGraph | None = None) -> list[TaskTimeout]:
    """The ``execution_timeout`` of every task of a validated ``PipelineSpec``, in graph order:
    ``pipeline.tasks.<kind>``, else for a training task its run_timeout plus
    :data:`TRAIN_TIMEOUT_MARGIN_S`, else ``pipeline.defaults``. The DAG builder sets exactly
    these."""
    graph = graph or task_graph(spec)
    training = {stage.task_id: stage.training for stage in resolve_stages(spec)}
    stage_index = {stage.name: i for i, stage in enumerate(spec.stages or [])}
    out = []
    for node in graph.nodes:
        override = getattr(spec.pipeline.tasks, node.kind.value, None)
        in_worker = node.kind is not TaskKind.APPROVE_CHAMPION
        if node.kind is TaskKind.TRAIN:
            in_worker = not training[node.task_id].fault.deferrable
        if override is not None and override.execution_timeout is not None:
            seconds = override.execution_timeout
            keys = ("pipeline", "tasks", node.kind.value, "execution_timeout")
        elif node.kind is TaskKind.TRAIN:
            seconds = training[node.task_id].fault.run_timeout + TRAIN_TIMEOUT_MARGIN_S
            keys = ("training", "fault", "run_timeout")
            if node.stage is not None:
                index = stage_index[node.stage]
                fault = spec.stages[index].training.fault  # an override: None fields inherit
                if fault is not None and fault.run_timeout is not None:
                    keys = ("stages", index, *keys)
        else:
            seconds = spec.pipeline.defaults.execution_timeout
            keys = ("pipeline", "defaults", "execution_timeout")
        out.append(TaskTimeout(node.task_id, node.kind, seconds, keys, in_worker))
    return out
