"""The DAG file and builder: four pipeline tasks (one training task per stage) and the
``close_run`` teardown after all of them, typed params, broken specs isolated, cheap parsing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainforge.dag_builder import build_dag, build_dags
from trainforge.graph import task_graph
from trainforge.pipeline import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"


def test_demo_dag_has_four_tasks_in_order_and_typed_params():
    dag = build_dag(load_spec(DEMO), str(DEMO))
    assert dag.dag_id == "shakespeare_llm"
    assert [t.task_id for t in dag.topological_sort()] == [
        "prepare_data", "train", "validate_checkpoint", "register_model", "close_run"]
    assert dag.get_task("train").execution_timeout.total_seconds() == 3600 + 600
    params = dag.params
    assert params["max_steps"] == 300
    schema = params.get_param("max_steps").schema
    assert schema["type"] == "integer" and schema["minimum"] == 1
    assert params.get_param("learning_rate").schema["type"] == "number"
    assert "trainforge" in dag.tags and "demo" in dag.tags


def test_a_broken_spec_never_hides_the_others(tmp_path):
    good = DEMO.read_text()
    (tmp_path / "a_good.yaml").write_text(good)
    (tmp_path / "b_bad.yaml").write_text(good.replace("name: shakespeare_llm", "name: other")
                                         .replace("max_steps: 300", "max_stepz: 300"))
    (tmp_path / "c_dup.yaml").write_text(good)
    dags, errors = build_dags(tmp_path)
    assert list(dags) == ["shakespeare_llm"]
    bad = errors[str(tmp_path / "b_bad.yaml")]
    assert isinstance(bad, SpecError)
    assert any("did you mean 'max_steps'" in i.message for i in bad.issues)
    assert "already used by" in str(errors[str(tmp_path / "c_dup.yaml")])


def test_a_spec_whose_dag_cannot_be_built_never_hides_the_others(tmp_path, monkeypatch):
    """A valid spec that still fails to build (a bug of ours, a limit of Airflow's) is that
    file's error, not the whole DAG file's import error."""
    import trainforge.dag_builder as builder

    good = DEMO.read_text()
    (tmp_path / "a_good.yaml").write_text(good)
    (tmp_path / "b_breaks.yaml").write_text(good.replace("name: shakespeare_llm", "name: breaks"))
    real = builder.build_dag

    def build(spec, spec_file=""):
        if spec.dag_id == "breaks":
            raise OverflowError("Python int too large to convert to C int")
        return real(spec, spec_file=spec_file)

    monkeypatch.setattr(builder, "build_dag", build)
    dags, errors = build_dags(tmp_path)
    assert list(dags) == ["shakespeare_llm"]
    [issue] = errors[str(tmp_path / "b_breaks.yaml")].issues
    assert issue.message == ("no DAG could be built from this spec (OverflowError: Python int "
                             "too large to convert to C int)")


def test_dag_file_warns_per_yaml_file_and_line_and_imports_nothing_heavy(tmp_path):
    (tmp_path / "bad.yaml").write_text(DEMO.read_text().replace("num_heads: 6", "num_heads: 5"))
    (tmp_path / "good.yaml").write_text(DEMO.read_text())
    code = (
        "import sys, warnings; sys.path.insert(0, 'dags')\n"
        "import trainforge.dag_builder  # Airflow's logging set-up first: it captures warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import trainforge_pipelines as m\n"
        "print('DAGS', sorted(k for k, v in vars(m).items() if type(v).__name__ == 'DAG'))\n"
        "print('WARN', [(x.filename.rsplit('/', 1)[-1], x.lineno) for x in w if 'trainforge' in str(x.message)])\n"
        "print('HEAVY', sorted(m for m in ('torch', 'mlflow', 'transformers', 'boto3', 'kubernetes',"
        " 'ray', 'psycopg2') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRAINFORGE_PIPELINES": str(tmp_path)}, timeout=120)
    assert "DAGS ['shakespeare_llm']" in out.stdout, out.stderr[-3000:]
    # the warning points at the line of the mistake: the field the cross-field rule names
    heads_line = DEMO.read_text().splitlines().index("  num_heads: 6") + 1
    assert f"WARN [('bad.yaml', {heads_line})]" in out.stdout
    assert "HEAVY []" in out.stdout


@pytest.mark.parametrize("override,fragment", [
    ({"max_steps": 0}, "max_steps"),
    ({"micro_batch_size": 7}, "divisible"),
])
def test_bad_trigger_params_fail_the_first_task_before_anything_runs(override, fragment):
    from airflow.sdk.exceptions import AirflowFailException

    from trainforge.tasks.prepare_data import PrepareDataOperator

    spec = load_spec(DEMO)
    op = PrepareDataOperator(task_id="prepare_data", spec=spec.model_dump(mode="json"))
    params = {**{"max_steps": 300, "micro_batch_size": 8}, **override}
    with pytest.raises(AirflowFailException, match=fragment):
        op.resolved_spec({"params": params})


STAGED_TAIL = {
    "chain": """\
stages:
  - name: pretrain
    training:
      optimization: {max_steps: 100}
      fault: {run_timeout: 2h}
  - name: finetune
    depends_on: [pretrain]
    init_from: pretrain
    training:
      optimization: {max_steps: 50, learning_rate: 1e-4, warmup_steps: 5}
      checkpoint: {interval_steps: 25}
""",
    "sweep": """\
stages:
  - name: lr_high
    training:
      optimization: {learning_rate: 6e-3}
  - name: lr_low
    training:
      optimization: {learning_rate: 1e-3}
""",
}


def _staged(kind: str):
    from trainforge.pipeline import parse_spec_text

    return parse_spec_text(DEMO.read_text() + STAGED_TAIL[kind], f"{kind}.yaml")


def _edges(dag) -> set[tuple[str, str]]:
    """The pipeline's edges, the teardown's left out (see test_every_task_feeds_the_teardown)."""
    return {(t.task_id, d) for t in dag.tasks for d in t.downstream_task_ids if d != "close_run"}


@pytest.mark.parametrize("kind", ["single", "chain", "sweep"])
def test_every_task_feeds_the_close_run_teardown_which_never_decides_the_run(kind):
    from airflow.task.trigger_rule import TriggerRule

    from trainforge.callbacks import clear_failure_on_success, close_mlflow_run_on_failure
    from trainforge.tasks.close_run import CloseRunOperator

    spec = load_spec(DEMO) if kind == "single" else _staged(kind)
    dag = build_dag(spec, f"{kind}.yaml")
    close = dag.get_task("close_run")
    assert isinstance(close, CloseRunOperator) and close.is_teardown
    assert close.trigger_rule == TriggerRule.ALL_DONE_SETUP_SUCCESS
    assert not close.on_failure_fail_dagrun  # its failure never fails the DAG run
    assert close.upstream_task_ids == set(dag.task_ids) - {"close_run"}
    assert not close.downstream_task_ids
    trains = {t.task_id: t.stage for t in dag.tasks if t.task_id.startswith("train")}
    assert {node.task_id: node.stage for node in task_graph(spec).train_nodes} == trains
    # A failed teardown must not end a finished MLflow run FAILED.
    assert close_mlflow_run_on_failure not in (close.on_failure_callback or [])
    assert close_mlflow_run_on_failure in dag.get_task("register_model").on_failure_callback
    assert clear_failure_on_success in dag.get_task("register_model").on_success_callback


def test_a_two_stage_chain_trains_one_task_per_stage_in_order():
    dag = build_dag(_staged("chain"), "chain.yaml")
    assert [t.task_id for t in dag.topological_sort()] == [
        "prepare_data", "train_pretrain", "train_finetune", "validate_checkpoint",
        "register_model", "close_run"]
    assert _edges(dag) == {("prepare_data", "train_pretrain"),
                           ("train_pretrain", "train_finetune"),
                           ("train_finetune", "validate_checkpoint"),
                           ("validate_checkpoint", "register_model")}
    pretrain, finetune = dag.get_task("train_pretrain"), dag.get_task("train_finetune")
    assert (pretrain.stage, finetune.stage) == ("pretrain", "finetune")
    # each stage's own run_timeout (+10 minutes) bounds its task
    assert pretrain.execution_timeout.total_seconds() == 2 * 3600 + 600
    assert finetune.execution_timeout.total_seconds() == 3600 + 600
    validate = dag.get_task("validate_checkpoint")
    assert validate.leaf_stages == ["finetune"]


def test_a_two_variant_sweep_runs_side_by_side_and_validates_both_leaves():
    dag = build_dag(_staged("sweep"), "sweep.yaml")
    assert _edges(dag) == {("prepare_data", "train_lr_high"), ("prepare_data", "train_lr_low"),
                           ("train_lr_high", "validate_checkpoint"),
                           ("train_lr_low", "validate_checkpoint"),
                           ("validate_checkpoint", "register_model")}
    assert dag.get_task("validate_checkpoint").leaf_stages == ["lr_high", "lr_low"]
    assert "train" not in dag.task_ids
    # trigger-form params stay those of the top-level training
    assert dag.params["learning_rate"] == pytest.approx(3e-3)


def test_a_stage_task_resolves_its_merged_training_with_trigger_params():
    dag = build_dag(_staged("chain"), "chain.yaml")
    params = {"learning_rate": 2e-3, "max_steps": 300}
    pretrain = dag.get_task("train_pretrain").resolved_spec({"params": params})
    finetune = dag.get_task("train_finetune").resolved_spec({"params": params})
    assert pretrain.training.optimization.learning_rate == pytest.approx(2e-3)  # inherited
    assert pretrain.training.optimization.max_steps == 100  # the stage's own
    assert finetune.training.optimization.learning_rate == pytest.approx(1e-4)
    assert finetune.training.optimization.max_steps == 50


def test_pipeline_task_settings_of_train_apply_to_every_stage_task():
    text = DEMO.read_text().replace(
        "pipeline:\n", "pipeline:\n  tasks:\n    train:\n      retries: 4\n", 1)
    from trainforge.pipeline import parse_spec_text

    dag = build_dag(parse_spec_text(text + STAGED_TAIL["sweep"], "s.yaml"), "s.yaml")
    assert dag.get_task("train_lr_high").retries == dag.get_task("train_lr_low").retries == 4


def test_validation_picks_the_valid_leaf_with_the_lowest_validation_loss():
    from trainforge.tasks.validate_checkpoint import best_leaf

    results = [{"stage": "a", "metrics": {"val_loss": 2.5}},
               {"stage": "b", "metrics": {"val_loss": 2.1}},
               {"stage": "c", "metrics": {"val_loss": 2.1}}]
    assert best_leaf(results)["stage"] == "b"  # a tie goes to the stage declared first
    assert best_leaf([results[0]])["stage"] == "a"
    assert best_leaf([]) is None
