"""The DAG file and builder: four tasks, typed params, broken specs isolated, cheap parsing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from operators.dag_builder import build_dag, build_dags
from operators.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"


def test_demo_dag_has_four_tasks_in_order_and_typed_params():
    dag = build_dag(load_spec(DEMO), str(DEMO))
    assert dag.dag_id == "shakespeare_llm"
    assert [t.task_id for t in dag.topological_sort()] == [
        "prepare_data", "train", "validate_checkpoint", "register_model"]
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


def test_dag_file_warns_per_yaml_file_and_line_and_imports_nothing_heavy(tmp_path):
    (tmp_path / "bad.yaml").write_text(DEMO.read_text().replace("num_heads: 6", "num_heads: 5"))
    (tmp_path / "good.yaml").write_text(DEMO.read_text())
    code = (
        "import sys, warnings; sys.path.insert(0, 'dags')\n"
        "import operators.dag_builder  # Airflow's logging set-up first: it captures warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import trainforge_pipelines as m\n"
        "print('DAGS', sorted(k for k, v in vars(m).items() if type(v).__name__ == 'DAG'))\n"
        "print('WARN', [(x.filename.rsplit('/', 1)[-1], x.lineno) for x in w if 'trainforge' in str(x.message)])\n"
        "print('HEAVY', sorted(m for m in ('torch', 'mlflow', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRAINFORGE_PIPELINES": str(tmp_path)}, timeout=120)
    assert "DAGS ['shakespeare_llm']" in out.stdout, out.stderr[-3000:]
    model_line = DEMO.read_text().splitlines().index("model:") + 1
    assert f"WARN [('bad.yaml', {model_line})]" in out.stdout
    assert "HEAVY []" in out.stdout


@pytest.mark.parametrize("override,fragment", [
    ({"max_steps": 0}, "max_steps"),
    ({"micro_batch_size": 7}, "divisible"),
])
def test_bad_trigger_params_fail_the_first_task_before_anything_runs(override, fragment):
    from airflow.sdk.exceptions import AirflowFailException

    from operators.prepare import PrepareDataOperator

    spec = load_spec(DEMO)
    op = PrepareDataOperator(task_id="prepare_data", spec=spec.model_dump(mode="json"))
    params = {**{"max_steps": 300, "micro_batch_size": 8}, **override}
    with pytest.raises(AirflowFailException, match=fragment):
        op.resolved_spec({"params": params})
