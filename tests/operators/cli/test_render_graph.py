"""`trainforge render` shows the DAG's wiring (a sweep differs from a chain) and says when a
stage keeps an engine of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainforge.cli.main import app
from trainforge.dag_builder import build_dag
from trainforge.graph import CLOSE_RUN_TASK_ID
from trainforge.pipeline import load_spec

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"
CHAIN = """
stages:
  - name: pretrain
  - name: finetune
    depends_on: [pretrain]
    init_from: pretrain
"""
SWEEP = """
stages:
  - name: lr_high
    training: {optimization: {learning_rate: 6e-3}}
  - name: lr_low
    training: {optimization: {learning_rate: 1e-3}}
"""
runner = CliRunner()


def _spec(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(DEMO.read_text() + extra)
    return path


@pytest.mark.parametrize(("extra", "edges"), [
    ("", [["prepare_data", "train"], ["train", "validate_checkpoint"],
          ["validate_checkpoint", "register_model"]]),
    (CHAIN, [["prepare_data", "train_pretrain"], ["train_pretrain", "train_finetune"],
             ["train_finetune", "validate_checkpoint"], ["validate_checkpoint", "register_model"]]),
    (SWEEP, [["prepare_data", "train_lr_high"], ["prepare_data", "train_lr_low"],
             ["train_lr_high", "validate_checkpoint"], ["train_lr_low", "validate_checkpoint"],
             ["validate_checkpoint", "register_model"]]),
], ids=["single", "chain", "sweep"])
def test_render_lists_the_edges_of_the_dag_airflow_builds(tmp_path, extra, edges):
    path = _spec(tmp_path, extra)
    result = runner.invoke(app, ["render", str(path)])
    assert result.exit_code == 0, result.output
    rendered = json.loads(result.stdout)
    # every task feeds the close_run teardown
    tasks = sorted({task for edge in edges for task in edge})
    edges = edges + [[task, "close_run"] for task in rendered["tasks"][:-1]]
    assert rendered["edges"] == edges
    assert sorted(rendered["tasks"]) == sorted([*tasks, "close_run"])
    assert rendered["teardown"] == CLOSE_RUN_TASK_ID
    dag = build_dag(load_spec(path), str(path))
    built = sorted([up, task.task_id] for task in dag.tasks for up in task.upstream_task_ids)
    assert sorted(edges) == built
    assert [t.task_id for t in dag.tasks if t.is_teardown] == [rendered["teardown"]]


def test_a_stage_with_its_own_engine_keeps_it_and_render_says_so(tmp_path):
    path = _spec(tmp_path, SWEEP.replace(
        "training: {optimization: {learning_rate: 1e-3}}",
        "training: {engine: ray, ray: {address: 'http://127.0.0.1:8265'}}"))
    result = runner.invoke(app, ["render", str(path), "--engine", "slurm"])
    assert result.exit_code == 0, result.output
    assert ("note: stage 'lr_low' sets its own engine 'ray' and keeps it" in result.stderr)
    requests = json.loads(result.stdout)["train_requests"]
    assert "submit_job" in requests["train_lr_low"]  # the Ray job API's request
    assert "submit_job" not in requests["train_lr_high"]


def test_the_placeholder_note_names_spec_fields_not_training_fields():
    result = runner.invoke(app, ["render", str(DEMO), "--engine", "kubernetes"])
    assert result.exit_code == 0, result.output
    assert "  spec field data.output_uri: s3://your-bucket/datasets" in result.stderr
    assert "training spec field" not in result.stderr


def test_render_imports_no_airflow():
    """`render` is a cheap dry run: it names the teardown task without importing Airflow."""
    import subprocess
    import sys

    code = ("import sys; from typer.testing import CliRunner; from trainforge.cli.main import app; "
            f"r = CliRunner().invoke(app, ['render', {str(DEMO)!r}]); assert r.exit_code == 0; "
            "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:] + out.stderr[-2000:]
