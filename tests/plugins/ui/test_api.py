"""The UI's JSON API through FastAPI's TestClient, behind Airflow's Simple auth manager.

Airflow's metadata is a fresh SQLite database in this process (tests/plugins/ui/airflow_db.py); MLflow
is the session's real server, holding one seeded DAG run's MLflow run and a registered model.
"""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest

from tests.plugins.ui.airflow_db import TASKS, airflow_metadata, seed_dag, seed_run, token

DAG, OTHER, RUN = "ui_pipe", "not_trainforge", "manual__2026-01-01T00:00:00+00:00"
MODEL = "ui-pipe-model"
REPORT = {"checkpoint": "/ck/step_40", "step": 40, "candidates": [
    {"checkpoint": "/ck/step_40", "step": 40, "ok": True, "val_loss": 2.5, "failed": []},
    {"checkpoint": "/ck/step_20", "step": 20, "ok": False, "val_loss": None,
     "failed": ["integrity"]}],
    "quarantined": [{"checkpoint": "/ck/step_20", "moved_to": "/ck/quarantine/step_20",
                     "reasons": ["integrity: shard 0 sha256 mismatch"]}]}


def _seed_mlflow(url: str) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(url)
    exp = client.create_experiment(f"ui-api-{time.time_ns()}")
    run = client.create_run(exp, tags={"trainforge.dag_id": DAG, "trainforge.airflow_run_id": RUN,
                                       "trainforge.registered_model": MODEL,
                                       "trainforge.gate.decision": "pass"})
    rid = run.info.run_id
    client.log_param(rid, "optim.max_steps", "100")
    for step in range(10, 50, 10):
        client.log_metric(rid, "train_loss", 5.0 - step / 20, step=step)
        client.log_metric(rid, "learning_rate", 1e-3 * step / 40, step=step)
    for key, value in {"accounting/gpu_hours": 0.5, "accounting/cost": 1.25,
                       "accounting/energy_kwh": 0.2, "accounting/wall_s": 1800.0,
                       "badput/checkpoint_save_s": 12.0, "goodput/percent": 91.5}.items():
        client.log_metric(rid, key, value)
    client.set_tag(rid, "energy/source/gpu0", "measured-nvml")
    client.log_dict(rid, REPORT, "validation/report.json")
    client.create_registered_model(MODEL)
    for value, decision in ((3.1, "pass"), (2.7, "pass")):
        version = client.create_model_version(MODEL, f"{run.info.artifact_uri}/model", rid,
                                              tags={"trainforge.gate.metric": "val_loss",
                                                    "trainforge.gate.candidate_value": str(value),
                                                    "trainforge.gate.decision": decision})
    client.set_registered_model_alias(MODEL, "champion", version.version)
    return rid


@pytest.fixture(scope="module")
def api(tmp_path_factory, mlflow_server):
    from fastapi.testclient import TestClient
    from airflow.utils.session import create_session

    mlflow_run = _seed_mlflow(mlflow_server)
    with airflow_metadata(tmp_path_factory.mktemp("ui-api") / "airflow.db"):
        with create_session() as session:
            seed_dag(session, DAG)
            seed_dag(session, OTHER, tags=("other",))
            seed_run(session, DAG, RUN, dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1),
                     {t: "success" for t in TASKS}, {
                         "validate_checkpoint": {"checkpoint": "/ck/step_40", "step": 40,
                                                 "metrics": {"val_loss": 2.5}},
                         "register_model": {"name": MODEL, "version": "2",
                                            "aliases": ["challenger", "champion"],
                                            "gate": {"decision": "pass", "reason": "first",
                                                     "metric": "val_loss"}}})
        from trainforge.plugins.ui.app import app

        with TestClient(app) as client:
            client.mlflow_run = mlflow_run
            yield client


@pytest.fixture
def admin():
    return {"Authorization": f"Bearer {token('admin', 'admin')}"}


@pytest.fixture
def mlflow_up(monkeypatch, mlflow_server):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)


@pytest.mark.parametrize("path", ["/api/training", "/api/training/totals",
                                  f"/api/runs/{DAG}/{RUN}", "/api/cluster",
                                  "/training", "/cluster", f"/run?dag_id={DAG}&run_id=x",
                                  "/static/ui.js"])
def test_every_endpoint_needs_a_signed_in_user(api, path):
    refused = api.get(path)
    assert refused.status_code == 401
    html = refused.headers["content-type"].startswith("text/html")
    assert html == ("/api/" not in path and "/static/" not in path)  # pages: a readable page
    assert api.get(path, cookies={"_token": "forged"}).status_code in (401, 403)


def test_training_lists_the_pipelines_with_mlflow_figures(api, admin, mlflow_up):
    resp = api.get("/api/training", headers=admin)
    assert resp.status_code == 200, resp.text
    assert "frame-ancestors 'self'" in resp.headers["content-security-policy"]
    data = resp.json()
    assert data["partial"] is False, data["unavailable"]
    [pipe] = data["pipelines"]  # the DAG without the trainforge tag is not a pipeline
    assert pipe["dag_id"] == DAG and pipe["runs"][0]["run_id"] == RUN
    assert pipe["runs"][0]["progress"]["step"] == 40 and pipe["runs"][0]["progress"]["max_steps"] == 100
    assert pipe["champion"]["version"] == "2" and pipe["champion"]["value"] == 2.7
    assert [t["value"] for t in pipe["trend"]] == [3.1, 2.7]
    assert "last_30d" not in pipe  # the window's totals come from the second route


def test_training_totals_give_the_window_figures(api, admin, mlflow_up):
    resp = api.get("/api/training/totals", headers=admin)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["partial"] is False and data["window_days"] == 30
    assert data["last_30d"] == {DAG: {"runs": 1, "gpu_hours": 0.5, "cost": 1.25,
                                      "energy_kwh": 0.2, "goodput_percent": 91.5}}


def test_run_view_has_curves_checkpoints_gate_and_figures(api, admin, mlflow_up):
    resp = api.get(f"/api/runs/{DAG}/{RUN}", headers=admin)
    assert resp.status_code == 200, resp.text
    d = resp.json()
    assert not d["partial"], d["unavailable"]
    assert [p["step"] for p in d["curves"]["train_loss"]] == [10, 20, 30, 40]
    assert len(d["curves"]["learning_rate"]) == 4
    quarantined = [c for c in d["checkpoints"] if c["quarantined_to"]]
    assert quarantined[0]["quarantine_reasons"] == ["integrity: shard 0 sha256 mismatch"]
    assert [c["checkpoint"] for c in d["checkpoints"] if c["chosen"]] == ["/ck/step_40"]
    assert d["gate"]["decision"] == "pass" and d["model"]["aliases"] == ["challenger", "champion"]
    f = d["figures"]
    assert f["badput_s"] == {"checkpoint_save": 12.0} and f["cost"] == 1.25
    assert f["energy_source"] == {"gpu0": "measured-nvml"}
    assert d["mlflow"]["run_id"] == api.mlflow_run and d["mlflow"]["url"].endswith(api.mlflow_run)
    assert [t["task_id"] for t in d["tasks"]] == list(TASKS)
    assert d["tasks"][1]["log_url"].startswith(f"/dags/{DAG}/runs/")


def test_unknown_run_is_404(api, admin, mlflow_up):
    resp = api.get(f"/api/runs/{DAG}/no_such_run", headers=admin)
    assert resp.status_code == 404 and "no_such_run" in resp.json()["detail"]


def test_a_user_without_dag_access_gets_403_and_an_empty_list(api):
    nobody = {"Authorization": f"Bearer {token('nobody', None)}"}
    data = api.get(f"/api/runs/{DAG}/{RUN}", headers=nobody)
    assert data.status_code == 403 and data.json() == {"detail": f"no read access to DAG {DAG!r}"}
    # the run tab shows a page a person reads, not the JSON above
    page = api.get(f"/run?dag_id={DAG}&run_id={RUN}", headers=nobody)
    assert page.status_code == 403 and page.headers["content-type"].startswith("text/html")
    assert "<h1>Forbidden</h1>" in page.text
    assert "no read access to DAG &#x27;ui_pipe&#x27;" in page.text  # escaped, never HTML
    assert "frame-ancestors 'self'" in page.headers["content-security-policy"]
    resp = api.get("/api/training", headers=nobody)
    assert resp.status_code == 200 and resp.json()["pipelines"] == []
    resp = api.get("/api/training/totals", headers=nobody)
    assert resp.status_code == 200 and resp.json()["last_30d"] == {}


def test_mlflow_down_gives_a_partial_answer_naming_it(api, admin, monkeypatch):
    from tests.faults.faultlib import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    run = api.get(f"/api/runs/{DAG}/{RUN}", headers=admin).json()
    training = api.get("/api/training", headers=admin).json()
    totals = api.get("/api/training/totals", headers=admin).json()
    assert time.monotonic() - started < 15
    for d in (run, training, totals):
        assert d["partial"] is True
        assert d["unavailable"][0]["source"] == "mlflow"
        assert "did not answer" in d["unavailable"][0]["error"]
    assert run["run"]["state"] == "success" and run["gate"]["decision"] == "pass"  # from Airflow
    assert run["checkpoints"][0]["checkpoint"] == "/ck/step_40"
    assert training["pipelines"][0]["runs"][0]["run_id"] == RUN


def test_cluster_lists_jobs_with_their_run_and_names_an_engine_that_fails(api, admin):
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.trigger import Trigger
    from airflow.utils.session import create_session
    from sqlalchemy import update

    secret = "s3cr3t-value-never-shown"
    with create_session() as session:
        trigger = Trigger(classpath="trainforge.triggers.TrainingJobTrigger", kwargs={
            "engine": "nosuch", "backend_kwargs": {"token": secret},
            "handle": {"engine": "nosuch", "key": "ui-pipe-train-t1-abc"}})
        session.add(trigger)
        session.flush()
        session.execute(update(TaskInstance).where(TaskInstance.dag_id == DAG,
                                                   TaskInstance.task_id == "train")
                        .values(state="deferred", trigger_id=trigger.id))
    try:
        resp = api.get("/api/cluster", headers=admin)
        assert resp.status_code == 200
        assert secret not in resp.text
        d = resp.json()
        [job] = d["jobs"]
        assert (job["dag_id"], job["run_id"], job["task_id"]) == (DAG, RUN, "train")
        assert job["job"] == "ui-pipe-train-t1-abc" and job["answered"] is False
        assert d["partial"] and d["unavailable"][0]["source"] == "nosuch"
    finally:
        with create_session() as session:
            session.execute(update(TaskInstance).where(TaskInstance.dag_id == DAG,
                                                       TaskInstance.task_id == "train")
                            .values(state="success", trigger_id=None))


def test_pages_and_static_files_are_served_with_the_policy(api, admin):
    page = api.get("/training", headers=admin)
    assert page.status_code == 200 and 'data-page="training"' in page.text
    js = api.get("/static/ui.js", headers=admin)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert api.get("/static/../app.py", headers=admin).status_code == 404
    assert "script-src 'self'" in js.headers["content-security-policy"]
    assert json.loads(api.get("/api/cluster", headers=admin).text)["jobs"] == []
