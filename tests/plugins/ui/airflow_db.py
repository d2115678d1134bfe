"""Airflow's metadata database in this process, for the UI's API tests and benchmark.

:func:`airflow_metadata` points Airflow's ORM at a fresh SQLite file (tables created from the
models, no migrations: a second) and sets up the auth manager of the configuration (Simple
auth manager); on exit the ORM goes back to what it was. :func:`seed_run` writes one trainforge
DAG run as the scheduler would leave it (DAG, tag, run, task instances, XCom results).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TASKS = ("prepare_data", "train", "validate_checkpoint", "register_model", "close_run")


@contextlib.contextmanager
def airflow_metadata(path: Path) -> Iterator[None]:
    from airflow import settings
    from airflow.api_fastapi.app import create_auth_manager
    from airflow.configuration import conf
    from airflow.models import import_all_models
    from airflow.models.base import Base

    before = conf.get("database", "sql_alchemy_conn")
    conf.set("database", "sql_alchemy_conn", f"sqlite:///{path}")
    settings.configure_vars()  # the ORM reads the URL from settings, set at import
    settings.configure_orm()
    if str(settings.engine.url) != f"sqlite:///{path}":
        raise RuntimeError(f"Airflow's ORM still points at {settings.engine.url}")
    try:
        import_all_models()
        Base.metadata.create_all(settings.engine)
        create_auth_manager().init()
        yield
    finally:
        conf.set("database", "sql_alchemy_conn", before)
        settings.configure_vars()
        settings.configure_orm()


def token(username: str, role: str | None) -> str:
    """A JWT of the Simple auth manager for a user with ``role`` (None: no role at all)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=username, role=role))


def seed_dag(session, dag_id: str, tags: tuple[str, ...] = ("trainforge",)) -> None:
    from airflow.models.dag import DagModel, DagTag
    from airflow.models.dagbundle import DagBundleModel

    if session.get(DagBundleModel, "dags-folder") is None:
        session.add(DagBundleModel(name="dags-folder"))
        session.flush()
    session.add(DagModel(dag_id=dag_id, bundle_name="dags-folder", is_stale=False,
                         is_paused=False, fileloc=f"/dags/{dag_id}.py"))
    session.flush()
    for tag in tags:
        session.add(DagTag(name=tag, dag_id=dag_id))


def seed_run(session, dag_id: str, run_id: str, start: dt.datetime, states: dict[str, str],
             results: dict[str, Any] | None = None, run_state: str = "success") -> None:
    """One DAG run with a task instance per task (``states``: task id -> state) and XCom
    return values (``results``: task id -> value)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from uuid6 import uuid7

    run = DagRun(dag_id=dag_id, run_id=run_id, run_type="manual", state=run_state,
                 run_after=start, start_date=start, logical_date=None)
    session.add(run)
    session.flush()
    for i, (task_id, state) in enumerate(states.items()):
        begin = start + dt.timedelta(seconds=10 * i)
        session.execute(TaskInstance.__table__.insert().values(
            id=uuid7(), dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=-1,
            state=state, try_number=1, start_date=begin,
            end_date=begin + dt.timedelta(seconds=9) if state == "success" else None,
            duration=9.0 if state == "success" else None, pool="default_pool", pool_slots=1,
            priority_weight=1, queue="default", max_tries=0, hostname="", unixname=""))
    for task_id, value in (results or {}).items():
        session.execute(XComModel.__table__.insert().values(
            dag_run_id=run.id, dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=-1,
            key="return_value", value=value, timestamp=start))
