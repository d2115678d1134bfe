"""The ``close_run`` teardown (operators/tasks/close_run.py) against a real MLflow server on loopback and
real local-engine jobs (torchrun running the backend tests' stand-in workload).

``CloseRunOperator.close`` is given the task states Airflow would report; the Airflow side (the
Task SDK reading those states, the teardown's failure not failing the DAG run) is the last test,
under ``airflow dags test``; tests/faults/test_teardown_closes_runs.py runs it under
``airflow standalone``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.local.backend import LocalBackend
from trainforge.hooks.mlflow import MlflowHook
from trainforge.pipeline import load_spec, parse_spec_text
from trainforge.tasks.close_run import (
    TAG_CANCELLED_JOBS,
    TAG_CLOSED_BY,
    TAG_KEPT_JOBS,
    TAG_NOT_SUCCEEDED,
    CloseRunOperator,
    run_end_status,
    task_jobs,
)

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "tests" / "faults" / "fault_tiny.yaml"
FAKE_DIR = ROOT / "tests" / "operators" / "engines"
FAILED_AFTER_TRAIN = {"prepare_data": "success", "train": "failed",
                      "validate_checkpoint": "upstream_failed",
                      "register_model": "upstream_failed"}
ALL_SUCCEEDED = dict.fromkeys(["prepare_data", "train", "validate_checkpoint",
                               "register_model"], "success")


@pytest.fixture
def world(tmp_path, monkeypatch, mlflow_server):
    """TRAINFORGE_HOME, the spec (own experiment per test), a DAG run id, the MLflow hook, and a
    job submitter whose jobs are all cancelled at the end."""
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    raw = load_spec(SPEC).model_dump(mode="json")
    raw["pipeline"]["mlflow_experiment"] = f"teardown-{time.time_ns()}"
    backend = LocalBackend(tmp_path / "runs", cwd=str(FAKE_DIR))
    submitted = []

    def submit(task_id: str, try_number: int, **fake):
        handle = backend.submit(TrainingJob(
            identity=JobIdentity("fault_tiny", "manual__r1", task_id, try_number),
            config={"fake": {"lines": 1, **fake}}, module="fake_trainer"))
        submitted.append(handle)
        return handle

    class World:
        pass

    w = World()
    w.raw, w.backend, w.submit, w.home = raw, backend, submit, tmp_path
    w.hook = MlflowHook(tracking_uri=mlflow_server)
    w.server = mlflow_server
    yield w
    for handle in submitted:
        backend.cancel(handle, grace_s=5)


def _operator(raw, server, retries=0) -> CloseRunOperator:
    return CloseRunOperator(task_id="close_run", spec=raw, mlflow_tracking_uri=server,
                            retries=retries)


def _spec(raw):
    from trainforge.pipeline.spec import PipelineSpec

    return PipelineSpec.model_validate(raw)


def _wait_state(backend, handle, states, timeout_s=120.0) -> JobState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = backend.status(handle).state
        if state in states:
            return state
        time.sleep(0.5)
    pytest.fail(f"job {handle['key']} never reached {states} (last {state})")


def test_a_live_job_is_cancelled_a_finished_one_untouched_and_the_run_ends_killed_once(world):
    finished = world.submit("train", 1, exit_code=3)  # try 1 failed (transient) on its own
    live = world.submit("train", 2, sleep_s=300)  # try 2's job, orphaned by a killed task
    _wait_state(world.backend, finished, {JobState.FAILED})
    _wait_state(world.backend, live, {JobState.RUNNING})
    exit_before = (Path(finished["job_dir"]) / "exit.json").read_bytes()
    spec = _spec(world.raw)
    run_id = world.hook.get_or_create_run(spec.experiment_name, "fault_tiny", "manual__r1")
    op = _operator(world.raw, world.server, retries=1)

    report = op.close(spec, "fault_tiny", "manual__r1", FAILED_AFTER_TRAIN, {})

    assert report.cancelled_jobs == [live["key"]] and report.kept_jobs == []
    assert world.backend.status(live).state == JobState.CANCELLED
    assert json.loads((Path(live["job_dir"]) / "exit.json").read_text())["cancelled"] is True
    assert (Path(finished["job_dir"]) / "exit.json").read_bytes() == exit_before  # untouched
    assert world.backend.status(finished).state == JobState.FAILED
    assert report.ended_runs == {run_id: "KILLED"} and report.problems == []
    run = world.hook.client.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.end_time
    assert run.data.tags[TAG_CLOSED_BY] == "close_run"
    assert run.data.tags[TAG_NOT_SUCCEEDED] == "register_model, train, validate_checkpoint"
    assert run.data.tags[TAG_CANCELLED_JOBS] == live["key"]

    again = op.close(spec, "fault_tiny", "manual__r1", FAILED_AFTER_TRAIN, {})
    assert (again.cancelled_jobs, again.ended_runs, again.problems) == ([], {}, [])
    after = world.hook.client.get_run(run_id)
    assert (after.info.status, after.info.end_time) == ("KILLED", run.info.end_time)
    assert after.data.tags == run.data.tags


def test_cancel_on_kill_false_keeps_the_job_and_says_so_on_the_run(world, capsys):
    world.raw["training"]["fault"]["cancel_on_kill"] = False
    live = world.submit("train", 1, sleep_s=300)
    _wait_state(world.backend, live, {JobState.RUNNING})
    spec = _spec(world.raw)
    run_id = world.hook.get_or_create_run(spec.experiment_name, "fault_tiny", "manual__r1")
    op = _operator(world.raw, world.server)

    report = op.close(spec, "fault_tiny", "manual__r1", FAILED_AFTER_TRAIN, {})

    assert report.kept_jobs == [live["key"]] and report.cancelled_jobs == []
    assert world.backend.status(live).state == JobState.RUNNING
    assert "cancel_on_kill is false" in capsys.readouterr().out  # the task log
    run = world.hook.client.get_run(run_id)
    # Not cancelled, and the task did not succeed: FAILED; a cleared task reopens it.
    assert run.info.status == "FAILED" and run.data.tags[TAG_KEPT_JOBS] == live["key"]


def test_a_failed_stage_run_is_closed_and_a_finished_one_left_alone(world):
    raw = parse_spec_text(SPEC.read_text() + (
        "stages:\n  - name: pretrain\n  - name: finetune\n    depends_on: [pretrain]\n"),
        "staged.yaml").model_dump(mode="json")
    raw["pipeline"]["mlflow_experiment"] = world.raw["pipeline"]["mlflow_experiment"]
    spec = _spec(raw)
    hook, client = world.hook, world.hook.client
    parent = hook.get_or_create_run(spec.experiment_name, "fault_tiny", "manual__r1")
    experiment = client.get_run(parent).info.experiment_id

    def child(stage):  # as TrainOperator._stage_run_id creates them
        return client.create_run(experiment, run_name=stage, tags={
            "mlflow.parentRunId": parent, "trainforge.stage": stage,
            "trainforge.pipeline": "fault_tiny"}).info.run_id

    pretrain, finetune = child("pretrain"), child("finetune")
    hook.end_run(pretrain, "FINISHED")
    failed = world.submit("train_finetune", 1, exit_code=3)
    _wait_state(world.backend, failed, {JobState.FAILED})
    states = {"prepare_data": "success", "train_pretrain": "success",
              "train_finetune": "failed", "validate_checkpoint": "upstream_failed",
              "register_model": "upstream_failed"}
    op = _operator(raw, world.server)  # the stages come from the spec's task graph

    report = op.close(spec, "fault_tiny", "manual__r1", states,
                      {"train_pretrain": {"last_checkpoint": "/c/step-1"}})

    assert report.ended_runs == {parent: "FAILED", finetune: "FAILED"}
    assert client.get_run(pretrain).info.status == "FINISHED"
    assert TAG_CLOSED_BY not in client.get_run(pretrain).data.tags
    tags = client.get_run(finetune).data.tags
    assert tags[TAG_CLOSED_BY] == "close_run"
    assert tags[TAG_NOT_SUCCEEDED] == "register_model, train_finetune, validate_checkpoint"


@pytest.mark.parametrize(("results", "status"), [
    ({"register_model": {"name": "m", "version": "3"}}, "FINISHED"),
    ({}, "FAILED"),
], ids=["registered", "not-registered"])
def test_a_run_left_running_by_a_successful_pipeline_ends_by_whether_it_registered(
        world, capsys, results, status):
    spec = _spec(world.raw)
    run_id = world.hook.get_or_create_run(spec.experiment_name, "fault_tiny", "manual__r1")
    op = _operator(world.raw, world.server)
    report = op.close(spec, "fault_tiny", "manual__r1", ALL_SUCCEEDED, results)
    assert report.ended_runs == {run_id: status}
    assert "still RUNNING although every task succeeded" in capsys.readouterr().out
    assert world.hook.client.get_run(run_id).data.tags[TAG_NOT_SUCCEEDED] == "none"


def test_a_successful_pipeline_is_left_alone(world):
    live = world.submit("train", 1, sleep_s=300)  # a succeeded task's job is never touched
    _wait_state(world.backend, live, {JobState.RUNNING})
    spec = _spec(world.raw)
    run_id = world.hook.get_or_create_run(spec.experiment_name, "fault_tiny", "manual__r1")
    world.hook.end_run(run_id, "FINISHED")
    op = _operator(world.raw, world.server)
    report = op.close(spec, "fault_tiny", "manual__r1", ALL_SUCCEEDED,
                      {"register_model": {"version": "1"}})
    assert (report.cancelled_jobs, report.ended_runs, report.problems) == ([], {}, [])
    assert world.backend.status(live).state == JobState.RUNNING
    assert TAG_CLOSED_BY not in world.hook.client.get_run(run_id).data.tags


def test_an_mlflow_outage_is_reported_after_the_jobs_are_cancelled(world, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    live = world.submit("train", 1, sleep_s=300)
    _wait_state(world.backend, live, {JobState.RUNNING})
    op = _operator(world.raw, "http://127.0.0.1:9")
    report = op.close(_spec(world.raw), "fault_tiny", "manual__r1", FAILED_AFTER_TRAIN, {})
    assert report.cancelled_jobs == [live["key"]]
    assert world.backend.status(live).state == JobState.CANCELLED
    [problem] = report.problems
    assert problem.startswith("MLflow runs of DAG run manual__r1: MlflowRequestError")


def test_the_job_search_steps_over_tries_that_adopted_an_earlier_job():
    """Try 2 and 3 adopted try 1's job (no job of their own); try 4 launched one."""
    class Engine:
        def __init__(self, tries):
            self.tries, self.asked = tries, []

        def find(self, identity):
            self.asked.append(identity.try_number)
            return {"key": f"k{identity.try_number}"} if identity.try_number in self.tries \
                else None

    engine = Engine({1, 4})
    found = task_jobs(engine, "d", "r", "train", expected_tries=2)
    assert [t for t, _ in found] == [1, 4]
    assert engine.asked == [1, 2, 3, 4, 5, 6, 7]  # three misses past the last job, then stop


@pytest.mark.parametrize(("kwargs", "status"), [
    ({"all_succeeded": True, "finished": True, "job_states": []}, "FINISHED"),
    ({"all_succeeded": True, "finished": False, "job_states": []}, "FAILED"),
    ({"all_succeeded": False, "finished": False, "job_states": [JobState.CANCELLED]}, "KILLED"),
    ({"all_succeeded": False, "finished": False,
      "job_states": [JobState.CANCELLED, JobState.FAILED]}, "FAILED"),
    ({"all_succeeded": False, "finished": False, "job_states": [None]}, "FAILED"),
    ({"all_succeeded": False, "finished": False, "job_states": [JobState.RUNNING]}, "FAILED"),
])
def test_the_end_status_rule(kwargs, status):
    assert run_end_status(**kwargs) == status


# -- under Airflow itself ---------------------------------------------------------------------

DAG_FILE = '''
import datetime as dt

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG

from trainforge.pipeline.loader import load_spec
from trainforge.tasks.close_run import CloseRunOperator

raw = load_spec({spec!r}).model_dump(mode="json")
raw["pipeline"]["mlflow_experiment"] = {experiment!r}


def open_run(ti, **_):
    from trainforge.hooks.mlflow import MlflowHook

    MlflowHook().get_or_create_run({experiment!r}, ti.dag_id, ti.run_id)


def train(**_):
    raise RuntimeError("training broke")


for dag_id, broken, tracking_uri in (("teardown_failed", True, None),
                                     ("teardown_hiccup", False, "http://127.0.0.1:9")):
    with DAG(dag_id=dag_id, schedule=None,
             start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)) as dag:
        tasks = [
            PythonOperator(task_id="prepare_data", python_callable=open_run),
            PythonOperator(task_id="train", python_callable=train if broken else lambda: None),
            PythonOperator(task_id="register_model", python_callable=lambda: {{"version": "1"}}),
        ]
        tasks[0] >> tasks[1] >> tasks[2]
        tasks >> CloseRunOperator(task_id="close_run", spec=raw,
                                  mlflow_tracking_uri=tracking_uri).as_teardown()
    globals()[dag_id] = dag
'''


@pytest.mark.airflow
def test_under_airflow_the_teardown_reads_the_task_states_and_never_decides_the_run(
        tmp_path, mlflow_server):
    """``airflow dags test`` (what ``trainforge run`` uses): with a failed task, close_run runs
    after it, reads the states through the Task SDK and ends the run FAILED; with an MLflow
    outage on a successful run, close_run fails and the DAG run still succeeds."""
    import os
    import sqlite3
    import subprocess
    import sys

    from mlflow import MlflowClient

    experiment = f"teardown-airflow-{time.time_ns()}"
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "teardown_dags.py").write_text(DAG_FILE.format(spec=str(SPEC), experiment=experiment))
    airflow_home = tmp_path / "airflow"
    airflow_home.mkdir()
    env = {**os.environ, "TRAINFORGE_HOME": str(tmp_path), "AIRFLOW_HOME": str(airflow_home),
           "AIRFLOW__CORE__DAGS_FOLDER": str(dags), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home / 'airflow.db'}",
           "MLFLOW_TRACKING_URI": mlflow_server, "PYTHONPATH": str(ROOT),
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    outputs = {}
    for dag_id in ("teardown_failed", "teardown_hiccup"):
        proc = subprocess.run([airflow, "dags", "test", dag_id], env=env, text=True,
                              capture_output=True, timeout=300)
        outputs[dag_id] = proc.stdout + proc.stderr
    with sqlite3.connect(airflow_home / "airflow.db") as db:
        runs = dict(db.execute("SELECT dag_id, state FROM dag_run").fetchall())
        tis = {(d, t): s for d, t, s in db.execute(
            "SELECT dag_id, task_id, state FROM task_instance").fetchall()}
        run_ids = dict(db.execute("SELECT dag_id, run_id FROM dag_run").fetchall())

    failed = outputs["teardown_failed"][-6000:]
    assert runs["teardown_failed"] == "failed", failed
    assert tis[("teardown_failed", "train")] == "failed"
    assert tis[("teardown_failed", "register_model")] == "upstream_failed"
    assert tis[("teardown_failed", "close_run")] == "success", failed
    client = MlflowClient(mlflow_server)
    [run] = client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id],
        f"tags.`trainforge.airflow_run_id` = '{run_ids['teardown_failed']}'")
    assert run.info.status == "FAILED"  # no job was cancelled: FAILED, not KILLED
    assert run.data.tags[TAG_CLOSED_BY] == "close_run"
    assert run.data.tags[TAG_NOT_SUCCEEDED] == "register_model, train"

    hiccup = outputs["teardown_hiccup"][-6000:]
    assert tis[("teardown_hiccup", "close_run")] == "failed", hiccup
    assert runs["teardown_hiccup"] == "success", hiccup  # a teardown never fails the run
    assert "close_run could not finish for DAG run teardown_hiccup/" in hiccup
