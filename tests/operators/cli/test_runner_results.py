"""trainforge run reads the finished DAG run from its own metadata DB, not two CLI starts.

The tables come from Airflow's own SQLAlchemy models (``create_all`` on a SQLite file), so a
column Airflow renames breaks this test rather than the runner's summary.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from trainforge.cli.runner import _latest_run, _task_times


@pytest.fixture(scope="module")
def metadata_db(tmp_path_factory) -> Path:
    from airflow.models import import_all_models
    from airflow.models.base import Base
    from sqlalchemy import create_engine

    db = tmp_path_factory.mktemp("airflow") / "airflow.db"
    engine = create_engine(f"sqlite:///{db}")
    import_all_models()
    Base.metadata.create_all(engine)
    engine.dispose()
    return db


def _insert(db: Path, table: str, **row) -> None:
    with sqlite3.connect(db) as conn:
        cols = ", ".join(row)
        conn.execute(f"INSERT INTO {table} ({cols}) VALUES ({', '.join('?' * len(row))})",
                     tuple(row.values()))


def test_the_latest_run_and_its_task_times_come_from_the_db(metadata_db):
    env = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{metadata_db}"}
    for run_id, start, state in (("manual__1", "2026-12-01 10:00:00.000000", "failed"),
                                 ("manual__2", "2026-12-01 11:00:00.000000", "success")):
        _insert(metadata_db, "dag_run", dag_id="p", run_id=run_id, state=state, run_type="manual",
                start_date=start, logical_date=start, run_after=start,
                end_date="2026-12-01 11:05:00.500000",
                clear_number=0, log_template_id=None, span_status="not_started")
    _insert(metadata_db, "task_instance", id="0190f1a0-0000-7000-8000-000000000001", dag_id="p",
            run_id="manual__2", task_id="train", map_index=-1, state="success", try_number=1,
            start_date="2026-12-01 11:00:01.000000", end_date="2026-12-01 11:04:31.250000",
            pool="default_pool", pool_slots=1, priority_weight=1, max_tries=0,
            dag_version_id=None, span_status="not_started", hostname="", unixname="",
            queue="default", custom_operator_name="", executor_config=b"", operator="X")
    _insert(metadata_db, "task_instance", id="0190f1a0-0000-7000-8000-000000000002", dag_id="p",
            run_id="manual__2", task_id="register_model", map_index=-1, state="running",
            try_number=1, start_date="2026-12-01 11:04:32.000000", end_date=None,
            pool="default_pool", pool_slots=1, priority_weight=1, max_tries=0,
            dag_version_id=None, span_status="not_started", hostname="", unixname="",
            queue="default", custom_operator_name="", executor_config=b"", operator="X")

    run = _latest_run("p", env)
    assert run == {"dag_id": "p", "run_id": "manual__2", "state": "success",
                   "logical_date": "2026-12-01T11:00:00+00:00",
                   "start_date": "2026-12-01T11:00:00+00:00",
                   "end_date": "2026-12-01T11:05:00.500000+00:00"}
    assert _task_times("p", "manual__2", env) == {
        "train": {"state": "success", "seconds": 270.25},
        "register_model": {"state": "running", "seconds": None}}
    assert _latest_run("other", env) is None


def test_no_metadata_db_means_no_run(tmp_path):
    env = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'missing.db'}"}
    assert _latest_run("p", env) is None
    assert _task_times("p", "manual__1", env) == {}
    assert not (tmp_path / "missing.db").exists()
