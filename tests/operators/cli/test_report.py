"""`trainforge report`: the ledger the train task logs, read back per pipeline from a real MLflow
server (the session's), as a table, JSON and a PNG plot; and the run summary's ledger row."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainforge.cli.main import app
from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.mlflow_runs import TAG_AIRFLOW_RUN_ID, TAG_DAG_ID
from trainforge.ledger import names as n
from trainforge.ledger.catalog import choose_price
from trainforge.ledger.read import ledger_figures, ledger_line
from trainforge.pipeline import load_spec
from trainforge.train_ledger import record_ledger

pytestmark = pytest.mark.integration

DEMO = Path(__file__).resolve().parents[3] / "dags" / "pipelines" / "shakespeare_llm.yaml"
runner = CliRunner()


def _attempts(t0: float) -> dict[str, str]:
    """Two attempts as the trainer records them: a kill after step 15, a resume from step 10."""
    def rec(started, first, recorded, productive, wasted, steps, resumed):
        return {"v": 1, "started_at": started, "first_step_at": first, "recorded_at": recorded,
                "final": resumed > 0, "resumed_step": resumed, "reached_step": 15, "step": 0,
                "productive_steps": steps, "wasted_steps": 5 if resumed else 0,
                "tokens_per_step": 128, "world_size": 2, "device": "cpu",
                "flops_per_token": 2e5, "seconds": {"startup": 3.0, "restore": 0.2 if resumed else 0,
                                                    "data_wait": 0.1, "save": 0.4, "eval": 0.0,
                                                    "wasted": wasted, "productive": productive}}
    records = [rec(t0 + 1, t0 + 4, t0 + 20, 15.0, 0.0, 15, 0),
               rec(t0 + 25, t0 + 28.2, t0 + 50, 15.0, 5.0, 15, 10)]
    return {f"trainforge.ledger.attempt.{int(r['started_at'] * 1000)}": json.dumps(r)
            for r in records}


def _pipeline_runs(hook: MlflowHook, pipeline: str) -> dict[str, str]:
    """Two DAG runs of ``pipeline``: one without stages, one whose stage ``pretrain`` has a
    child run; each with the ledger the train task logs."""
    spec = load_spec(DEMO)
    experiment = hook.client.create_experiment(f"{pipeline}-exp")
    ids = {}
    for airflow_run, stage in (("manual__1", None), ("manual__2", "pretrain")):
        parent = hook.client.create_run(experiment, tags={TAG_DAG_ID: pipeline,
                                                          TAG_AIRFLOW_RUN_ID: airflow_run}).info.run_id
        own = hook.get_or_create_child_run(parent, stage) if stage else parent
        t0 = time.time() - 60
        hook.set_tags(own, _attempts(t0))
        event = {"handle": {"submitted_at_epoch_s": t0 + 0.5, "identity": {"try_number": 1}},
                 "wall_s": 51.0, "ended_at_epoch_s": t0 + 51.5,
                 "phases": {"queue_wait": 0.3, "image_pull": "not applicable: no image"}}
        record_ledger(hook, spec, event, choose_price(spec), own_run=own, parent_run=parent,
                      stage=stage, task_started_s=t0, try_number=1)
        hook.log_metrics(parent, {"val/val_loss": 4.5 if stage else 5.0})
        hook.set_tags(parent, {"trainforge.registered_model": "demo-lm",
                               "trainforge.model_version": "2" if stage else "1"})
        ids[airflow_run] = parent
    return ids


def test_report_reads_every_run_of_a_pipeline_with_its_ledger(mlflow_server, tmp_path):
    hook = MlflowHook(tracking_uri=mlflow_server)
    pipeline = f"report_{time.time_ns()}"
    ids = _pipeline_runs(hook, pipeline)

    plain = hook.get_run(ids["manual__1"]).data
    ledger = ledger_figures(plain.metrics, plain.tags)
    assert ledger["figures"][n.DISRUPTIONS] == 1 and ledger["tags"]["energy/source/cpu"] == "estimated"
    assert "goodput " in ledger_line(ledger) and "1 disruption(s)" in ledger_line(ledger)
    staged = hook.get_run(ids["manual__2"]).data.metrics
    assert f"stage/pretrain/{n.GOODPUT}" in staged and n.GOODPUT not in staged
    artifact = Path(hook.client.download_artifacts(ids["manual__1"], n.ARTIFACT, str(tmp_path)))
    assert json.loads(artifact.read_text())["schema"] == n.SCHEMA

    plot = tmp_path / "report.png"
    out = runner.invoke(app, ["report", pipeline, "--tracking-uri", mlflow_server, "--json",
                              "--plot", str(plot)])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert [r["airflow_run_id"] for r in report["runs"]] == ["manual__1", "manual__2"]
    for row, parent in zip(report["runs"], ids.values()):
        metrics = hook.get_run(parent).data.metrics
        goodput = metrics.get(n.GOODPUT, metrics.get(f"stage/pretrain/{n.GOODPUT}"))
        assert row["figures"][n.GOODPUT] == pytest.approx(goodput)
        assert 0 < row["figures"][n.GOODPUT] < 100
    assert [(v["version"], v["validation"]["val/val_loss"]) for v in report["versions"]] == \
        [("1", 5.0), ("2", 4.5)]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = runner.invoke(app, ["report", pipeline, "--tracking-uri", mlflow_server])
    assert table.exit_code == 0 and "manual__2" in table.output and "registered versions" in table.output


def test_report_of_an_unknown_pipeline_names_the_ones_the_store_has(mlflow_server):
    hook = MlflowHook(tracking_uri=mlflow_server)
    known = f"known_{time.time_ns()}"
    hook.client.create_run(hook.client.create_experiment(known), tags={TAG_DAG_ID: known})
    out = runner.invoke(app, ["report", "no_such_pipeline", "--tracking-uri", mlflow_server])
    assert out.exit_code == 1
    assert "no run of pipeline 'no_such_pipeline'" in out.output and known in out.output


@pytest.mark.parametrize("uri, says", [
    ("notascheme", "not an MLflow tracking URI (expected sqlite:///PATH"),
    ("sqlite:////nonexistent-store/mlflow.db", "no MLflow store at /nonexistent-store/mlflow.db"),
])
def test_a_store_that_cannot_be_read_is_named_and_never_created(uri, says):
    from trainforge.cli.report import StoreError, collect_report

    with pytest.raises(StoreError, match=re.escape(says)):
        collect_report("p", uri)
    assert not Path("/nonexistent-store").exists()


def test_a_server_that_does_not_answer_fails_in_seconds_naming_it():
    import socket

    from trainforge.cli.report import StoreError, collect_report

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}: the MLflow server does not answer"):
        collect_report("p", f"http://127.0.0.1:{port}")
    assert time.monotonic() - started < 10


def test_a_name_that_is_no_dag_id_is_refused_not_rewritten(mlflow_server):
    from trainforge.cli.report import UnknownPipelineError, collect_report

    with pytest.raises(UnknownPipelineError, match="is not a pipeline name"):
        collect_report("shakespeare'_llm", mlflow_server)
