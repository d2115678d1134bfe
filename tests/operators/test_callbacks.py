"""A task that fails for good ends the DAG run's MLflow run FAILED (real MLflow server)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from trainforge.callbacks import close_mlflow_run_on_failure
from trainforge.hooks.mlflow import MlflowHook
from trainforge.pipeline import load_spec

DEMO = Path(__file__).resolve().parents[2] / "dags" / "pipelines" / "shakespeare_llm.yaml"

pytestmark = pytest.mark.integration


def test_failure_callback_ends_the_run_failed_and_names_the_task(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    spec = load_spec(DEMO)
    hook = MlflowHook(tracking_uri=mlflow_server)
    run_id = hook.get_or_create_run(spec.experiment_name, spec.dag_id, "manual__callback-test")
    context = {
        "ti": SimpleNamespace(dag_id=spec.dag_id, run_id="manual__callback-test", task_id="train"),
        "task": SimpleNamespace(spec=spec.model_dump(mode="json")),
    }
    close_mlflow_run_on_failure(context)
    run = hook.client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["trainforge.failed_task"] == "train"


def test_failure_callback_never_raises_even_without_a_server(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    spec = load_spec(DEMO)
    context = {"ti": SimpleNamespace(dag_id=spec.dag_id, run_id="r", task_id="train"),
               "task": SimpleNamespace(spec=spec.model_dump(mode="json"))}
    close_mlflow_run_on_failure(context)  # logs a warning, raises nothing
