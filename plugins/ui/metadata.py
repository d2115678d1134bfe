"""What the pages read from Airflow's metadata database: trainforge DAGs, their runs, task
instances, earlier tries, XCom results and the triggers of deferred training tasks.

Every function takes the request's SQLAlchemy session and returns plain data (JSON-ready);
nothing here writes. A trainforge pipeline is a DAG tagged ``trainforge`` (the DAG builder tags
every DAG it builds so).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from airflow.models.dag import DagModel, DagTag
from airflow.models.dagrun import DagRun
from airflow.models.taskinstance import TaskInstance
from airflow.models.taskinstancehistory import TaskInstanceHistory
from airflow.models.trigger import Trigger
from airflow.models.xcom import XComModel

PIPELINE_TAG = "trainforge"
RUN = DagRun.__table__.c  # plain columns: ``state`` is a synonym on the ORM class
LIVE_TASK_STATES = ("queued", "scheduled", "running", "deferred", "up_for_retry")


def is_train_task(task_id: str) -> bool:
    """``train`` (a spec without stages) or ``train_<stage>`` (trainforge.pipeline.stages)."""
    return task_id == "train" or task_id.startswith("train_")


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def pipeline_ids(session: Session, readable: set[str] | None) -> list[str]:
    """The trainforge DAGs the user may read (``readable``: None for all), by id."""
    stmt = (select(DagModel.dag_id).join(DagTag, DagTag.dag_id == DagModel.dag_id)
            .where(DagTag.name == PIPELINE_TAG, DagModel.is_stale.is_(False))
            .order_by(DagModel.dag_id))
    if readable is not None:
        stmt = stmt.where(DagModel.dag_id.in_(readable))
    return list(session.scalars(stmt))


def pipelines(session: Session, dag_ids: list[str]) -> dict[str, dict[str, Any]]:
    rows = session.execute(select(DagModel.dag_id, DagModel.is_paused, DagModel.description)
                           .where(DagModel.dag_id.in_(dag_ids)))
    return {r.dag_id: {"dag_id": r.dag_id, "paused": bool(r.is_paused),
                       "description": r.description or ""} for r in rows}


def _run_row(row: Any) -> dict[str, Any]:
    return {"dag_id": row.dag_id, "run_id": row.run_id, "state": row.state,
            "run_type": row.run_type, "run_after": _iso(row.run_after),
            "start_date": _iso(row.start_date), "end_date": _iso(row.end_date)}


def recent_runs(session: Session, dag_ids: list[str], per_dag: int) -> dict[str, list[dict]]:
    """The newest ``per_dag`` runs of each DAG, newest first (one query: a window function)."""
    ranked = (select(RUN.dag_id, RUN.run_id, RUN.state, RUN.run_type, RUN.run_after,
                     RUN.start_date, RUN.end_date,
                     func.row_number().over(partition_by=RUN.dag_id,
                                            order_by=(RUN.run_after.desc(), RUN.id.desc()))
                     .label("rank"))
              .where(RUN.dag_id.in_(dag_ids)).subquery())
    rows = session.execute(select(ranked).where(ranked.c.rank <= per_dag)
                           .order_by(ranked.c.dag_id, ranked.c.rank))
    out: dict[str, list[dict]] = {dag_id: [] for dag_id in dag_ids}
    for row in rows:
        out[row.dag_id].append(_run_row(row))
    return out


def run_counts(session: Session, dag_ids: list[str], since: dt.datetime) -> dict[str, dict]:
    """Runs per DAG and state since ``since``."""
    rows = session.execute(select(RUN.dag_id, RUN.state, func.count()).where(
        RUN.dag_id.in_(dag_ids), RUN.run_after >= since).group_by(RUN.dag_id, RUN.state))
    out: dict[str, dict] = {}
    for dag_id, state, count in rows:
        out.setdefault(dag_id, {})[state or "none"] = count
    return out


def live_train_tasks(session: Session, dag_ids: list[str]) -> list[dict[str, Any]]:
    """Training task instances not finished yet, with their trigger's kwargs when deferred
    (the trigger carries the job's engine, backend settings and handle)."""
    rows = session.execute(
        select(TaskInstance.dag_id, TaskInstance.run_id, TaskInstance.task_id,
               TaskInstance.map_index, TaskInstance.state, TaskInstance.try_number,
               TaskInstance.start_date, TaskInstance.hostname, TaskInstance.trigger_id)
        .where(TaskInstance.dag_id.in_(dag_ids), TaskInstance.state.in_(LIVE_TASK_STATES))
        .order_by(TaskInstance.start_date))
    tasks = [dict(r._mapping) for r in rows if is_train_task(r.task_id)]
    trigger_ids = [t["trigger_id"] for t in tasks if t["trigger_id"] is not None]
    triggers = {t.id: t for t in session.scalars(select(Trigger).where(Trigger.id.in_(trigger_ids)))}
    for task in tasks:
        trigger = triggers.get(task.pop("trigger_id"))
        task["trigger_kwargs"] = trigger.kwargs if trigger is not None else None
        task["start_date"] = _iso(task["start_date"])
    return tasks


def dag_run(session: Session, dag_id: str, run_id: str) -> dict[str, Any] | None:
    row = session.execute(select(RUN.dag_id, RUN.run_id, RUN.state, RUN.run_type, RUN.run_after,
                                 RUN.start_date, RUN.end_date)
                          .where(RUN.dag_id == dag_id, RUN.run_id == run_id)).first()
    return _run_row(row) if row is not None else None


def task_tries(session: Session, dag_id: str, run_id: str) -> list[dict[str, Any]]:
    """Every try of every task of the run (earlier tries from the history table), by start."""
    tries = []
    for model in (TaskInstanceHistory, TaskInstance):
        rows = session.execute(
            select(model.task_id, model.map_index, model.try_number, model.state,
                   model.start_date, model.end_date, model.duration)
            .where(model.dag_id == dag_id, model.run_id == run_id))
        tries += [{**r._mapping, "start_date": _iso(r.start_date), "end_date": _iso(r.end_date),
                   "current": model is TaskInstance} for r in rows]
    return sorted(tries, key=lambda t: (t["start_date"] or "~", t["task_id"], t["try_number"]))


def return_values(session: Session, dag_id: str, run_id: str) -> dict[str, Any]:
    """The tasks' XCom return values (their results), by task id."""
    rows = session.scalars(select(XComModel).where(
        XComModel.dag_id == dag_id, XComModel.run_id == run_id,
        XComModel.key == "return_value", XComModel.map_index == -1))
    return {row.task_id: XComModel.deserialize_value(row) for row in rows}
