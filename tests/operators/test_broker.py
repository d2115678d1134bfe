"""The Celery broker's visibility timeout against tasks that hold a worker slot: what the DAG
builder sets, what ``trainforge validate`` warns about, and what a DAG file's parse warns about
with the deployment's own setting."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainforge.broker import ENV, EXECUTOR_ENV, Broker, environment_broker, visibility_warnings
from trainforge.cli.main import app
from trainforge.dag_builder import build_dag
from trainforge.graph import task_timeouts
from trainforge.pipeline import load_spec, parse_spec_text

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"
runner = CliRunner()


def _demo_with(old: str, new: str) -> str:
    text = DEMO.read_text()
    assert old in text
    return text.replace(old, new, 1)


#: The demo waiting in its worker slot for up to 3 days.
SYNC_3D = _demo_with("    run_timeout: 1h\n",
                     "    run_timeout: 3d\n    deferrable: false\n")

STAGES = """
stages:
  - name: pretrain
    training:
      fault: {run_timeout: 2d, deferrable: false}
  - name: finetune
    depends_on: [pretrain]
"""


def _spec(text: str, name: str = "spec.yaml"):
    return parse_spec_text(text, name)


@pytest.mark.parametrize("text", [
    DEMO.read_text(),
    SYNC_3D,
    _demo_with("    retries: 1\n", "    retries: 1\n    execution_timeout: 2h\n"),
    DEMO.read_text() + STAGES,
])
def test_the_dag_builder_sets_exactly_the_timeouts_the_check_compares(text):
    spec = _spec(text)
    dag = build_dag(spec, "spec.yaml")
    built = {t.task_id: (t.execution_timeout.total_seconds() if t.execution_timeout else None)
             for t in dag.tasks}
    assert built == {t.task_id: t.seconds for t in task_timeouts(spec)}


def test_a_task_override_is_the_timeout_and_the_field_named():
    text = SYNC_3D.replace("pipeline:\n", "pipeline:\n  tasks:\n    train: {execution_timeout: 4d}\n", 1)
    spec = _spec(text)
    train = next(t for t in task_timeouts(spec) if t.task_id == "train")
    assert (train.seconds, train.field, train.in_worker) == (
        4 * 86400, "pipeline.tasks.train.execution_timeout", True)
    assert build_dag(spec, "s.yaml").get_task("train").execution_timeout.total_seconds() == 4 * 86400


def test_a_non_deferrable_three_day_wait_is_past_the_default_visibility_timeout():
    found = visibility_warnings(_spec(SYNC_3D), Broker(86400, "Airflow's default"))
    assert [(w.task_id, w.field) for w in found] == [("train", "training.fault.run_timeout")]
    message = found[0].message
    assert "3d10m" in message and "1d" in message and "Airflow's default" in message
    assert "training.fault.deferrable: true" in message and "259800 s" in message


def test_a_deferrable_wait_a_short_one_or_no_celery_is_not_warned_about():
    deferrable = SYNC_3D.replace("    deferrable: false\n", "")
    assert visibility_warnings(_spec(deferrable), Broker(86400, "d")) == []
    assert visibility_warnings(_spec(SYNC_3D), Broker(4 * 86400, "set")) == []
    assert visibility_warnings(_spec(SYNC_3D), None) == []


def test_a_stage_names_its_own_field():
    spec = _spec(DEMO.read_text() + STAGES)
    found = visibility_warnings(spec, Broker(86400, "d"))
    assert [(w.task_id, w.field) for w in found] == [
        ("train_pretrain", "stages.0.training.fault.run_timeout")]


@pytest.mark.parametrize("executor, env, expected", [
    (None, None, 86400),
    ("CeleryExecutor", "3600", 3600),
    ("LocalExecutor,CeleryExecutor", None, 86400),
    ("LocalExecutor", "3600", None),
    ("airflow.providers.celery.executors.celery_executor.CeleryExecutor", "7200.0", 7200),
])
def test_the_environment_names_the_broker(monkeypatch, executor, env, expected):
    for name, value in ((EXECUTOR_ENV, executor), (ENV, env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    broker = environment_broker()
    assert (broker.visibility_timeout_s if broker else None) == expected
    assert environment_broker(60).visibility_timeout_s == 60  # the option wins


@pytest.mark.parametrize("value", ["inf", "1e400", "-inf", "nan"])
def test_an_infinite_setting_is_a_clear_error_in_validate_and_skipped_at_parse(
        monkeypatch, value, tmp_path, caplog):
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match="not a number of seconds"):
        environment_broker()
    result = runner.invoke(app, ["validate", str(DEMO)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    # The DAG processor's parse: the check is skipped with a warning, the DAG still loads.
    from trainforge.dag_files import COMPANION, companion_dags

    (tmp_path / "sync.yaml").write_text(SYNC_3D)
    (tmp_path / "sync.py").write_text(COMPANION)
    monkeypatch.setenv("TRAINFORGE_SPEC_CACHE", "off")
    monkeypatch.delenv("TRAINFORGE_PIPELINES", raising=False)
    monkeypatch.setenv(EXECUTOR_ENV, "CeleryExecutor")
    assert list(companion_dags(str(tmp_path / "sync.py"))) == ["shakespeare_llm"]
    assert "visibility timeout check is skipped" in caplog.text


def test_a_malformed_setting_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    monkeypatch.setenv(ENV, "a week")
    with pytest.raises(ValueError, match=f"{ENV}: not a number of seconds \\(got 'a week'\\)"):
        environment_broker()
    result = runner.invoke(app, ["validate", str(DEMO)])
    assert result.exit_code == 1 and "a week" in result.output
    assert "Traceback" not in result.output


def test_validate_warns_at_the_field_and_still_succeeds(tmp_path, monkeypatch):
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    monkeypatch.delenv(ENV, raising=False)
    spec = tmp_path / "sync.yaml"
    spec.write_text(SYNC_3D)
    line = SYNC_3D.splitlines().index("    run_timeout: 3d") + 1
    result = runner.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0, result.output
    assert f"{spec}:{line}:18: training.fault.run_timeout: warning: task 'train'" in result.output
    assert "not set here" in result.output  # where the 1 day comes from
    assert "ok (dag_id" in result.output
    quiet = runner.invoke(app, ["validate", "--visibility-timeout", "7d", str(spec)])
    assert quiet.exit_code == 0 and "warning" not in quiet.output
    monkeypatch.setenv(ENV, "604800")
    assert "warning" not in runner.invoke(app, ["validate", str(spec)]).output
    bad = runner.invoke(app, ["validate", "--visibility-timeout", "soon", str(spec)])
    assert bad.exit_code == 2 and "soon" in bad.output and "Traceback" not in bad.output


def test_the_dag_file_warns_with_the_deployments_setting(tmp_path, monkeypatch, caplog):
    """At parse (the DAG processor), the deployment's executor and visibility timeout decide;
    the warning is attributed to the spec's file and line, so Airflow lists it with the DAG
    file's warnings."""
    from trainforge.dag_files import COMPANION, companion_dags

    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "sync.yaml").write_text(SYNC_3D)
    (folder / "sync.py").write_text(COMPANION)
    monkeypatch.setenv("TRAINFORGE_SPEC_CACHE", "off")
    monkeypatch.delenv("TRAINFORGE_PIPELINES", raising=False)
    line = SYNC_3D.splitlines().index("    run_timeout: 3d") + 1

    monkeypatch.setenv(EXECUTOR_ENV, "CeleryExecutor")
    monkeypatch.setenv(ENV, "86400")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(companion_dags(str(folder / "sync.py"))) == [load_spec(folder / "sync.yaml").dag_id]
    ours = [w for w in caught if "visibility timeout" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == str(folder / "sync.yaml")
    assert ours[0].lineno == line
    assert "[celery_broker_transport_options] visibility_timeout" in str(ours[0].message)
    assert "visibility timeout" in caplog.text

    monkeypatch.setenv(EXECUTOR_ENV, "LocalExecutor")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        companion_dags(str(folder / "sync.py"))
    assert not [w for w in caught if "visibility timeout" in str(w.message)]
