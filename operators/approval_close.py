"""Approval requests close with their task: the listener half of ``approve_champion``.

A task parked in ``awaiting_input`` runs no code of its own, so when it ends without an answer
(marked failed or success by hand, its DAG run marked failed or success) no task callback runs.
Airflow's API server does fire listener hooks for those marks, with the task instance as a
database row; this module, an Airflow listener of the trainforge plugin, then:

* closes the pending request in Airflow's ``hitl_detail`` table (``responded_at`` set,
  ``Reject`` as its chosen option, the reason in its form) in the marking request's own
  transaction, so a later answer gets Airflow's 409 "already updated" instead of a 200 that
  resumes nothing;
* tags the model version ``trainforge.approval.status: cancelled`` with who marked it (from
  Airflow's audit log) and why. The version comes from the XCom the task pushed when it asked
  (:data:`REQUEST_XCOM_KEY`).

A cleared task asks again: Airflow would keep the first request's row (and its ``created_at``,
subject and body) for the new try, so when an ``approve_champion`` task instance gets a new try
id (:func:`forget_request_on_new_try`) its row is deleted once Airflow has copied it to the
request history; the next try posts a fresh request, and an answer in between gets a 404.

Hooks fired in a worker (with a Task SDK task instance, no database) do nothing here: there
the task answers for itself (trainforge.tasks.approve_champion).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from airflow.listeners import hookimpl

from trainforge.approval import (
    CANCELLED,
    REASON_PARAM,
    REJECT,
    TAG_AT,
    TAG_BY,
    TAG_REASON,
    TAG_STATUS,
)

log = logging.getLogger(__name__)

OPERATOR = "ApproveChampionOperator"  # the task_instance.operator of approve_champion tasks
REQUEST_XCOM_KEY = "trainforge_approval_request"  # {"name", "version", "tracking_uri"}
CLOSED_BY_ID = "trainforge"  # responded_by.id of a request closed without an answer
#: Audit-log events of the marks that end a task without an answer, and what they say.
MARK_EVENTS = {"patch_task_instance": "the task was marked {state}",
               "bulk_task_instances": "the task was marked {state}",
               "patch_task_group_instances": "its task group was marked {state}",
               "patch_dag_run": "the DAG run was marked {state}",
               "bulk_dag_runs": "the DAG run was marked {state}"}


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _is_ours(task_instance: Any) -> bool:
    """True for an ``approve_champion`` task instance read from the database (server side)."""
    if type(task_instance).__module__ != "airflow.models.taskinstance":
        return False  # a worker's Task SDK task instance: the task answers for itself
    return getattr(task_instance, "operator", None) == OPERATOR


def _marked_by(session: Any, ti: Any, state: str) -> tuple[str | None, str]:
    """(Airflow user, what happened) of the latest mark of ``ti`` in the audit log."""
    from airflow.models.log import Log
    from sqlalchemy import or_, select

    since = _utcnow() - dt.timedelta(minutes=5)
    row = session.scalars(
        select(Log).where(Log.dag_id == ti.dag_id, Log.run_id == ti.run_id,
                          or_(Log.task_id == ti.task_id, Log.task_id.is_(None)),
                          Log.event.in_(list(MARK_EVENTS)), Log.dttm >= since)
        .order_by(Log.dttm.desc()).limit(1)).first()
    if row is None:
        return None, f"the task ended {state} without an answer"
    return row.owner or None, MARK_EVENTS[row.event].format(state=state)


def _request_xcom(session: Any, ti: Any) -> dict[str, Any] | None:
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    row = session.scalars(select(XComModel).where(
        XComModel.dag_id == ti.dag_id, XComModel.run_id == ti.run_id,
        XComModel.task_id == ti.task_id, XComModel.map_index == ti.map_index,
        XComModel.key == REQUEST_XCOM_KEY)).first()
    value = XComModel.deserialize_value(row) if row is not None else None
    return value if isinstance(value, dict) else None


def close_request(session: Any, ti: Any, state: str) -> dict[str, str] | None:
    """Close ``ti``'s unanswered request in ``session``; the version's tags to write, or None
    when there was nothing to close (answered already, or never asked)."""
    from airflow.models.hitl import HITLDetail
    from sqlalchemy import select

    detail = session.scalars(select(HITLDetail).where(HITLDetail.ti_id == ti.id)).first()
    if detail is None or detail.responded_at is not None:
        return None
    by, what = _marked_by(session, ti, state)
    reason = f"cancelled: {what}" + (f" by {by}" if by else "") + " before anyone answered"
    now = _utcnow()
    detail.responded_at = now
    detail.responded_by = {"id": CLOSED_BY_ID, "name": f"trainforge (closed: {what})"}
    detail.chosen_options = [REJECT]
    detail.params_input = {REASON_PARAM: reason}
    session.add(detail)
    session.flush()
    log.warning("approval request of %s/%s/%s closed: %s", ti.dag_id, ti.run_id, ti.task_id,
                reason)
    return {TAG_STATUS: CANCELLED, TAG_BY: by or "unknown", TAG_REASON: reason,
            TAG_AT: now.isoformat(timespec="seconds")}


def _tag_version(request: dict[str, Any] | None, tags: dict[str, str], ti: Any) -> None:
    """Write ``tags`` on the requested version; a failure is logged (the request is closed)."""
    if not request or not request.get("name") or not request.get("version"):
        log.warning("approval request of %s/%s closed, but its XCom %r names no model version: "
                    "its tags say pending still", ti.dag_id, ti.run_id, REQUEST_XCOM_KEY)
        return
    try:
        from trainforge.hooks.mlflow import MlflowHook
        from trainforge.hooks.mlflow_registry import ModelRegistry

        ModelRegistry(MlflowHook(tracking_uri=request.get("tracking_uri"))).set_version_tags(
            request["name"], str(request["version"]), tags)
    except Exception:  # noqa: BLE001 - a listener must not fail the mark that fired it
        log.exception("approval request of %s v%s closed, but tagging the version failed",
                      request["name"], request["version"])


def _on_end(task_instance: Any, state: str) -> None:
    if not _is_ours(task_instance):
        return
    from sqlalchemy.orm import object_session

    try:
        session = object_session(task_instance)
        if session is not None:  # the marking request's transaction: closed as it commits
            tags = close_request(session, task_instance, state)
            request = _request_xcom(session, task_instance) if tags else None
        else:
            from airflow.utils.session import create_session

            with create_session() as own:
                tags = close_request(own, task_instance, state)
                request = _request_xcom(own, task_instance) if tags else None
        if tags is not None:
            _tag_version(request, tags, task_instance)
    except Exception:  # noqa: BLE001 - a listener must not fail the mark that fired it
        log.exception("closing the approval request of %s/%s failed", task_instance.dag_id,
                      task_instance.run_id)


@hookimpl
def on_task_instance_failed(previous_state: Any, task_instance: Any, error: Any) -> None:
    """Close the request of an ``approve_champion`` task marked (or made) failed."""
    _on_end(task_instance, "failed")


@hookimpl
def on_task_instance_success(previous_state: Any, task_instance: Any) -> None:
    """Close the request of an ``approve_champion`` task marked success without an answer."""
    _on_end(task_instance, "success")


def forget_request_on_new_try(mapper: Any, connection: Any, target: Any) -> None:
    """SQLAlchemy ``before_update`` of TaskInstance: a new try id of an ``approve_champion``
    task instance (a clear or a retry) deletes the old try's request row, which Airflow has
    already copied to ``hitl_detail_history``, so the next try posts a fresh one."""
    if getattr(target, "operator", None) != OPERATOR:
        return
    from airflow.models.hitl import HITLDetail
    from sqlalchemy import delete, inspect

    old_ids = inspect(target).attrs.id.history.deleted
    if old_ids and old_ids[0] is not None and old_ids[0] != target.id:
        connection.execute(delete(HITLDetail.__table__).where(
            HITLDetail.__table__.c.ti_id == old_ids[0]))


def install_clear_hook() -> None:
    """Register :func:`forget_request_on_new_try` (once per process)."""
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import event

    if not event.contains(TaskInstance, "before_update", forget_request_on_new_try):
        event.listen(TaskInstance, "before_update", forget_request_on_new_try)
