"""A burst of champion moves while the consumer runs: the newest is acted on, no event stranded.

Real parts: the session's MLflow server, its webhook (``python -m trainforge.mlflow_setup
webhook``) posting to the plugin's receiver inside ``airflow standalone``, the scheduler, and a
consumer built by ``trainforge.handoff.handoff_dag`` (the pattern of
``dags/model_handoff_example.py``, ``max_active_runs=1``) whose act only waits a few seconds.
While its first run acts, ``champion`` moves three more times within a second; in Airflow 3.3
the run after it is given only the events up to the first of those (Airflow #56050).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest
from mlflow import MlflowClient

from tests.faults.faultlib import AirflowStandalone, wait_for
from trainforge.handoff import acted_tag

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.heavy]

SECRET = "burst-" + uuid.uuid4().hex
DAG_ID = "burst_handoff"
ACT_S = 8  # the first run still acts while the burst comes
DAG_FILE = f'''"""The burst test's Airflow DAG: the shipped pattern, an act that only waits."""
import os
import time

from trainforge.handoff import handoff_dag


def act(name, version):
    time.sleep({ACT_S})
    return {{"version": version}}


dag = handoff_dag("{DAG_ID}", os.environ["BURST_MODEL"], act)
'''


@pytest.fixture(scope="module")
def burst_airflow(tmp_path_factory, mlflow_server):
    """airflow standalone serving only the burst consumer, with the webhook secret."""
    model_name = f"burst-{uuid.uuid4().hex[:8]}"
    home = tmp_path_factory.mktemp("burst-home")
    server = AirflowStandalone(home, mlflow_server, [])
    dags = home / "dags"
    dags.mkdir()
    (dags / "burst_handoff.py").write_text(DAG_FILE)
    server.env.update({
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "BURST_MODEL": model_name,
        "AIRFLOW_CONN_TRAINFORGE_MLFLOW_WEBHOOK": json.dumps(
            {"conn_type": "generic", "password": SECRET}),
    })
    try:
        server.start(ready_dag=DAG_ID)
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


def _move_champion(base: str, model_name: str, version: str) -> None:
    _mlflow_rest(base, "registered-models/alias",
                 {"name": model_name, "alias": "champion", "version": version})


def _queued_events(airflow: AirflowStandalone) -> list:
    try:
        return airflow.api("GET", f"/api/v2/dags/{DAG_ID}/assets/queuedEvents")["queued_events"]
    except urllib.error.HTTPError as err:
        if err.code == 404:  # none queued
            return []
        raise


def _champion_events(airflow: AirflowStandalone, model_name: str) -> list[dict]:
    events = airflow.api("GET", "/api/v2/assets/events?limit=100")["asset_events"]
    return [e for e in events if e["uri"] == f"trainforge-model-{model_name}"]


def test_a_burst_of_champion_moves_strands_no_event(burst_airflow, mlflow_server):
    airflow, model_name = burst_airflow
    registered = subprocess.run(
        [sys.executable, "-m", "trainforge.mlflow_setup", "webhook", "--tracking-uri",
         mlflow_server, "--url", f"{airflow.url}/trainforge-webhooks/mlflow",
         "--secret-env", "BURST_SECRET"],
        env={**os.environ, "BURST_SECRET": SECRET}, capture_output=True, text=True, timeout=60)
    assert registered.returncode == 0, registered.stderr
    webhook_id = registered.stdout.strip().splitlines()[-1]
    try:
        _mlflow_rest(mlflow_server, "registered-models/create", {"name": model_name})
        versions = [_mlflow_rest(mlflow_server, "model-versions/create", {
            "name": model_name, "source": f"s3://elsewhere/model-{i}"})["model_version"]["version"]
            for i in range(4)]
        time.sleep(2)  # the server sees a new webhook within 2 s (docs/registry.md)
        _move_champion(mlflow_server, model_name, versions[0])

        def acting():
            runs = airflow.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns")["dag_runs"]
            for run in runs:
                ti = airflow.ti(DAG_ID, run["dag_run_id"], "act_on_champion")
                if ti["state"] == "running":
                    return run["dag_run_id"]
            return None

        wait_for("the first run to act", acting, 120, 0.5)
        for version in versions[1:]:  # the burst: three moves within a second
            _move_champion(mlflow_server, model_name, version)

        def settled():
            events = _champion_events(airflow, model_name)
            runs = airflow.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns")["dag_runs"]
            busy = [r for r in runs if r["state"] in ("queued", "running")]
            return len(events) == 4 and not busy and not _queued_events(airflow) and runs

        runs = wait_for("the consumer to go idle", settled, 180, 1.0)
        events = _champion_events(airflow, model_name)
        # one event per delivery, each given to a run of the consumer
        assert sorted(e["extra"]["version"] for e in events) == sorted(versions), events
        stranded = [(e["id"], e["extra"]["version"]) for e in events
                    if not any(r["dag_id"] == DAG_ID for r in e["created_dagruns"])]
        assert stranded == [], f"events consumed by no run of {DAG_ID}: {stranded}"
        assert all(r["state"] == "success" for r in runs), runs
        # the newest champion was acted on (the tag is set once the act returned)
        client = MlflowClient(mlflow_server, mlflow_server)
        assert client.get_registered_model(model_name).tags[acted_tag(DAG_ID)] == versions[-1]
    finally:  # the session's MLflow server outlives this Airflow
        MlflowClient(mlflow_server, mlflow_server).delete_webhook(webhook_id)
