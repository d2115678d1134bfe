"""Two specs with one dag_id: `trainforge validate` names both places, the DAG file keeps one."""

from __future__ import annotations

import runpy
import shutil
import warnings
from pathlib import Path

from typer.testing import CliRunner

from trainforge.cli.main import app
from trainforge.dag_files import write_companions

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"

runner = CliRunner()


def test_validate_reports_a_dag_id_used_by_two_files(tmp_path):
    dup = tmp_path / "dup.yaml"
    shutil.copy(DEMO, dup)
    result = runner.invoke(app, ["validate", str(DEMO), str(dup)])
    assert result.exit_code == 1
    assert (f"{dup}:5:9: pipeline.name: dag_id 'shakespeare_llm' is also used by {DEMO}:5"
            in result.stderr)
    assert f"{DEMO}: ok (dag_id shakespeare_llm)" in result.stdout


def test_validate_reports_duplicates_inside_one_folder_but_not_a_file_named_twice(tmp_path):
    shutil.copy(DEMO, tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text(DEMO.read_text())
    result = runner.invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1
    assert f"{tmp_path / 'b.yaml'}:5:9: pipeline.name: dag_id 'shakespeare_llm' is also used by " \
           f"{tmp_path / 'a.yaml'}:5" in result.stderr
    again = runner.invoke(app, ["validate", str(tmp_path / "a.yaml"), str(tmp_path / "a.yaml")])
    assert again.exit_code == 0, again.output


def test_the_dag_file_skips_a_spec_whose_dag_id_a_generated_dag_file_defines(tmp_path,
                                                                              monkeypatch):
    monkeypatch.delenv("TRAINFORGE_PIPELINES", raising=False)
    monkeypatch.setenv("TRAINFORGE_SPEC_CACHE", "off")
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    shutil.copy(DEMO, pipelines / "shakespeare_llm.yaml")
    write_companions(pipelines)  # shakespeare_llm.py: its own DAG file
    text = DEMO.read_text()
    (pipelines / "other.yaml").write_text(text.replace("name: shakespeare_llm", "name: other"))
    (pipelines / "zz_dup.yaml").write_text(text)
    (pipelines / "b_broken.yaml").write_text(text.replace("name: shakespeare_llm", "name: b")
                                             .replace("max_steps: 300", "max_steps: many"))
    dag_file = tmp_path / "trainforge_pipelines.py"
    shutil.copy(ROOT / "dags" / "trainforge_pipelines.py", dag_file)
    import airflow.sdk  # noqa: F401 - Airflow's logging set-up replaces showwarning once, first

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = runpy.run_path(str(dag_file))
    assert "other" in names and "shakespeare_llm" not in names
    messages = [str(w.message) for w in caught if str(w.filename).endswith("zz_dup.yaml")]
    assert messages == [f"trainforge pipeline not loaded: {pipelines / 'zz_dup.yaml'}:5:9: "
                        f"pipeline.name: dag_id 'shakespeare_llm' is also used by "
                        f"{pipelines / 'shakespeare_llm.yaml'} (each pipeline needs its own name)"]
