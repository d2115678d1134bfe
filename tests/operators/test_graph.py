"""The task graph, pure: ids, kinds, stages and edges of single-stage and staged pipelines,
without Airflow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainforge.graph import CLOSE_RUN_TASK_ID, TaskKind, task_graph
from trainforge.pipeline import load_spec, parse_spec_text

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"
TAILS = {
    "single": "",
    "chain": """
stages:
  - name: pretrain
  - name: finetune
    depends_on: [pretrain]
    init_from: pretrain
""",
    "sweep": """
stages:
  - name: lr_high
    training: {optimization: {learning_rate: 6e-3}}
  - name: lr_low
    training: {optimization: {learning_rate: 1e-3}}
""",
    # declared before the stage it depends on: the graph still lists dependencies first
    "diamond": """
stages:
  - name: merge
    depends_on: [left, right]
  - name: left
  - name: right
""",
}
WORK_EDGES = {
    "single": [["prepare_data", "train"], ["train", "validate_checkpoint"],
               ["validate_checkpoint", "register_model"]],
    "chain": [["prepare_data", "train_pretrain"], ["train_pretrain", "train_finetune"],
              ["train_finetune", "validate_checkpoint"],
              ["validate_checkpoint", "register_model"]],
    "sweep": [["prepare_data", "train_lr_high"], ["prepare_data", "train_lr_low"],
              ["train_lr_high", "validate_checkpoint"], ["train_lr_low", "validate_checkpoint"],
              ["validate_checkpoint", "register_model"]],
    "diamond": [["prepare_data", "train_left"], ["prepare_data", "train_right"],
                ["train_left", "train_merge"], ["train_right", "train_merge"],
                ["train_merge", "validate_checkpoint"],
                ["validate_checkpoint", "register_model"]],
}


def _graph(kind: str):
    return task_graph(parse_spec_text(DEMO.read_text() + TAILS[kind], f"{kind}.yaml"))


@pytest.mark.parametrize("kind", list(TAILS))
def test_edges_feed_the_teardown_from_every_task(kind):
    graph = _graph(kind)
    work = [task for task in graph.task_ids if task != CLOSE_RUN_TASK_ID]
    assert graph.edges() == WORK_EDGES[kind] + [[task, CLOSE_RUN_TASK_ID] for task in work]
    assert graph.task_ids[-1] == CLOSE_RUN_TASK_ID == graph.teardown.task_id
    assert graph.teardown_ids == {CLOSE_RUN_TASK_ID}
    assert [n.task_id for n in graph.nodes if n.is_teardown] == [CLOSE_RUN_TASK_ID]


@pytest.mark.parametrize("kind", list(TAILS))
def test_upstream_tasks_come_first(kind):
    seen: set[str] = set()
    for node in _graph(kind).nodes:
        assert set(node.upstream) <= seen, node
        seen.add(node.task_id)


@pytest.mark.parametrize(("kind", "stages"), [
    ("single", {"train": None}),
    ("chain", {"train_pretrain": "pretrain", "train_finetune": "finetune"}),
    ("diamond", {"train_left": "left", "train_right": "right", "train_merge": "merge"}),
])
def test_training_tasks_carry_their_stage_and_the_train_kind(kind, stages):
    graph = _graph(kind)
    assert {n.task_id: n.stage for n in graph.train_nodes} == stages
    assert [n.kind for n in graph.nodes] == [
        TaskKind.PREPARE_DATA, *[TaskKind.TRAIN] * len(stages), TaskKind.VALIDATE_CHECKPOINT,
        TaskKind.REGISTER_MODEL, TaskKind.CLOSE_RUN]
    assert all(n.stage is None for n in graph.nodes if n.kind is not TaskKind.TRAIN)


def test_every_kind_but_the_teardown_has_task_settings_in_the_spec():
    spec = load_spec(DEMO)
    tasks = spec.pipeline.tasks
    assert {k.value for k in TaskKind if hasattr(tasks, k.value)} == {
        k.value for k in TaskKind} - {CLOSE_RUN_TASK_ID}


def test_an_unknown_task_id_is_a_key_error_naming_the_tasks():
    with pytest.raises(KeyError, match="no task 'train_x' in the pipeline .*prepare_data"):
        _graph("single").node("train_x")


def test_the_graph_imports_no_airflow():
    code = ("import sys; import trainforge.graph; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'airflow'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]
