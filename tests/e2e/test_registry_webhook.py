"""A person moves ``champion`` through MLflow's REST API; the example downstream DAG starts.

Real parts: the session's MLflow server (SQL store, tests/conftest.py), ``airflow standalone``
serving ``dags/model_handoff_example.py`` for one pipeline spec, the plugin's webhook receiver
inside its API server, the webhook registered with ``python -m trainforge.mlflow_setup
webhook``. MLflow signs and posts the delivery; the receiver checks it with the secret of the
Airflow connection, emits the asset event in Airflow's DB, and the scheduler starts the DAG run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.faults.faultlib import AirflowStandalone, wait_for

pytestmark = [pytest.mark.airflow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
SECRET = "handoff-" + uuid.uuid4().hex


def _spec(folder: Path, model_name: str) -> Path:
    text = (REPO / "tests" / "e2e" / "tiny_shakespeare.yaml").read_text()
    text = text.replace("name: tiny_shakespeare", "name: webhook_handoff")
    text = text.replace("model_name: tiny-shakespeare", f"model_name: {model_name}")
    spec = folder / "webhook_handoff.yaml"
    spec.write_text(text)
    return spec


@pytest.fixture(scope="module")
def handoff_airflow(tmp_path_factory, mlflow_server):
    """airflow standalone serving only the example downstream DAG for one model."""
    model_name = f"webhook-handoff-{uuid.uuid4().hex[:8]}"
    home = tmp_path_factory.mktemp("webhook-home")
    server = AirflowStandalone(home, mlflow_server, [_spec(home, model_name)])
    dags = home / "dags"
    dags.mkdir()
    shutil.copy(REPO / "dags" / "model_handoff_example.py", dags)
    server.env["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags)
    server.env["AIRFLOW_CONN_TRAINFORGE_MLFLOW_WEBHOOK"] = json.dumps(
        {"conn_type": "generic", "password": SECRET})
    try:
        server.start(ready_dag="webhook_handoff_model_handoff")
        yield server, model_name
    finally:
        try:
            server.end_leftovers()
        finally:
            server.stop()


def _mlflow_rest(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"{}")


def test_a_person_moving_champion_starts_the_downstream_dag(handoff_airflow, mlflow_server):
    airflow, model_name = handoff_airflow
    dag_id = "webhook_handoff_model_handoff"
    registered = subprocess.run(
        [sys.executable, "-m", "trainforge.mlflow_setup", "webhook", "--tracking-uri",
         mlflow_server, "--url", f"{airflow.url}/trainforge-webhooks/mlflow",
         "--secret-env", "HANDOFF_SECRET"],
        env={**os.environ, "HANDOFF_SECRET": SECRET}, capture_output=True, text=True, timeout=60)
    assert registered.returncode == 0, registered.stderr
    webhook_id = registered.stdout.strip().splitlines()[-1]
    try:
        # a version made by hand, as a person would: no pipeline, no trainforge tags
        _mlflow_rest(mlflow_server, "registered-models/create", {"name": model_name})
        version = _mlflow_rest(mlflow_server, "model-versions/create", {
            "name": model_name, "source": "s3://elsewhere/model"})["model_version"]["version"]
        assert airflow.api("GET", f"/api/v2/dags/{dag_id}/dagRuns")["total_entries"] == 0

        _mlflow_rest(mlflow_server, "registered-models/alias",
                     {"name": model_name, "alias": "champion", "version": version})

        def started():
            runs = airflow.api("GET", f"/api/v2/dags/{dag_id}/dagRuns")["dag_runs"]
            return [r for r in runs if r["run_type"] == "asset_triggered"]

        runs = wait_for(f"{dag_id} to start from the asset event", started, 180, 2.0)
        assert len(runs) == 1
        events = airflow.api("GET", "/api/v2/assets/events?limit=50")["asset_events"]
        ours = [e for e in events if e["extra"].get("name") == model_name]
        assert len(ours) == 1, ours
        assert ours[0]["extra"]["version"] == str(version)
        assert ours[0]["extra"]["alias"] == "champion" and ours[0]["extra"]["source"] == "mlflow-webhook"
        assert ours[0]["uri"] == f"trainforge-model-{model_name}"
    finally:  # the session's MLflow server outlives this Airflow
        MlflowClient(mlflow_server, mlflow_server).delete_webhook(webhook_id)
