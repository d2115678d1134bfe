"""Approval requests close with their task: the listener half of ``approve_champion``.

A task parked in ``awaiting_input`` runs no code of its own, so when it ends without an answer
(marked failed or success by hand, its DAG run marked, or a task upstream of it such as
``validate_checkpoint`` marked failed, with or without its downstream tasks) no task callback
runs. Airflow's API server does fire listener hooks for those marks, with the task instance as
a database row; this module, an Airflow listener of the trainforge plugin, then:

* closes the pending request in Airflow's ``hitl_detail`` table (or, when the mark cleared the
  approval, its try's copy in the request history): ``responded_at`` set, ``Reject`` chosen,
  the reason in its form, in the marking request's own transaction, so a later answer gets
  Airflow's 409 and a task resumed by the closed request fails;
* tags the model version ``trainforge.approval.status: cancelled`` naming the marked task and
  who marked it (Airflow's audit log). The version, and the tasks upstream of the approval,
  come from the XCom the task pushed when it asked (:data:`REQUEST_XCOM_KEY`).

A cleared task asks again: when an ``approve_champion`` task instance gets a new try id
(:func:`forget_request_on_new_try`) its request row is deleted once Airflow has copied it to the
request history, so the next try posts a fresh request (an answer in between gets a 404).
Hooks fired in a worker (a Task SDK task instance, no database) do nothing here: there the task
answers for itself. The story: docs/registry.md, "Ended without an answer" and "The champion
invariant".
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from airflow.listeners import hookimpl

from trainforge.approval import (
    CANCELLED,
    CLOSED_BY_ID,
    REASON_PARAM,
    REJECT,
    TAG_AT,
    TAG_BY,
    TAG_DAG_RUN,
    TAG_HISTORY,
    TAG_REASON,
    TAG_STATUS,
    TAG_TRY,
    with_history,
)

log = logging.getLogger(__name__)

OPERATOR = "ApproveChampionOperator"  # the task_instance.operator of approve_champion tasks
#: {"name", "version", "tracking_uri", "upstream": [task ids upstream of the approval]}
REQUEST_XCOM_KEY = "trainforge_approval_request"
#: Audit-log events of the marks that end a task without an answer, and what they say.
MARK_EVENTS = {"patch_task_instance": "the task was marked {state}",
               "bulk_task_instances": "the task was marked {state}",
               "patch_task_group_instances": "its task group was marked {state}",
               "patch_dag_run": "the DAG run was marked {state}",
               "bulk_dag_runs": "the DAG run was marked {state}"}


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _is_row(task_instance: Any) -> bool:
    """True for a task instance read from the database (server side); False for a worker's
    Task SDK task instance, where the task answers for itself."""
    return type(task_instance).__module__ == "airflow.models.taskinstance"


def _is_ours(task_instance: Any) -> bool:
    """True for an ``approve_champion`` task instance read from the database (server side)."""
    return _is_row(task_instance) and getattr(task_instance, "operator", None) == OPERATOR


def _marked_by(session: Any, ti: Any, state: str, marked: str | None = None
               ) -> tuple[str | None, str]:
    """(Airflow user, what happened) of the latest mark in ``ti``'s DAG run in the audit log;
    ``marked``: the task whose mark fired the listener (default ``ti``'s)."""
    import json

    from airflow.models.log import Log
    from sqlalchemy import select

    marked = marked or ti.task_id
    since = _utcnow() - dt.timedelta(minutes=5)
    row = session.scalars(
        select(Log).where(Log.dag_id == ti.dag_id, Log.run_id == ti.run_id,
                          Log.event.in_(list(MARK_EVENTS)), Log.dttm >= since)
        .order_by(Log.dttm.desc()).limit(1)).first()
    if row is None:
        if marked != ti.task_id:
            return None, f"{marked} ended {state}"
        return None, f"the task ended {state} without an answer"
    what = MARK_EVENTS[row.event].format(state=state)
    if row.task_id and row.task_id != ti.task_id and what.startswith("the task "):
        try:
            downstream = bool(json.loads(row.extra or "{}").get("include_downstream"))
        except (ValueError, AttributeError):
            downstream = False
        what = (f"{row.task_id} was marked {state}"
                + (" with its downstream tasks" if downstream else ""))
    return row.owner or None, what


def _request_xcom(session: Any, ti: Any) -> dict[str, Any] | None:
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    row = session.scalars(select(XComModel).where(
        XComModel.dag_id == ti.dag_id, XComModel.run_id == ti.run_id,
        XComModel.task_id == ti.task_id, XComModel.map_index == ti.map_index,
        XComModel.key == REQUEST_XCOM_KEY)).first()
    value = XComModel.deserialize_value(row) if row is not None else None
    return value if isinstance(value, dict) else None


def _open_request(session: Any, ti: Any) -> Any:
    """``ti``'s unanswered request row, or None. A mark with downstream tasks clears the
    approval in the same transaction (a new try id): its request then sits in Airflow's
    request history, under the newest recorded try."""
    from airflow.models.hitl import HITLDetail
    from airflow.models.hitl_history import HITLDetailHistory
    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from sqlalchemy import select

    detail = session.scalars(select(HITLDetail).where(HITLDetail.ti_id == ti.id)).first()
    if detail is None:
        old = session.scalars(select(TaskInstanceHistory.task_instance_id).where(
            TaskInstanceHistory.dag_id == ti.dag_id, TaskInstanceHistory.run_id == ti.run_id,
            TaskInstanceHistory.task_id == ti.task_id,
            TaskInstanceHistory.map_index == ti.map_index)
            .order_by(TaskInstanceHistory.try_number.desc()).limit(1)).first()
        if old is not None:
            detail = session.scalars(select(HITLDetailHistory).where(
                HITLDetailHistory.ti_history_id == old)).first()
    return detail if detail is not None and detail.responded_at is None else None


def _resume(session: Any, ti: Any, detail: Any) -> None:
    """Resume ``ti`` with the closed request when it still waits (an upstream task was marked,
    not the approval itself), as Airflow's API resumes it on an answer: the task then fails."""
    from airflow.models.hitl import HITLDetail
    from airflow.models.trigger import handle_event_submit
    from airflow.triggers.base import TriggerEvent
    from airflow.utils.state import TaskInstanceState

    parked = (TaskInstanceState.AWAITING_INPUT, TaskInstanceState.DEFERRED)
    if isinstance(detail, HITLDetail) and getattr(ti, "state", None) in parked:
        handle_event_submit(TriggerEvent(detail.as_resume_event_payload()), task_instance=ti,
                            session=session)


def close_request(session: Any, ti: Any, state: str, marked: str | None = None
                  ) -> dict[str, str] | None:
    """Close ``ti``'s unanswered request in ``session``; the version's tags to write, or None
    when there was nothing to close (answered already, or never asked). ``marked``: the task
    whose mark ends the approval (default ``ti``'s own; else an upstream task)."""
    detail = _open_request(session, ti)
    if detail is None:
        return None
    by, what = _marked_by(session, ti, state, marked)
    reason = f"cancelled: {what}" + (f" by {by}" if by else "") + " before anyone answered"
    now = _utcnow()
    detail.responded_at = now
    detail.responded_by = {"id": CLOSED_BY_ID, "name": f"trainforge (closed: {what})"}
    detail.chosen_options = [REJECT]
    detail.params_input = {REASON_PARAM: reason}
    session.add(detail)
    session.flush()
    _resume(session, ti, detail)
    log.warning("approval request of %s/%s/%s closed: %s", ti.dag_id, ti.run_id, ti.task_id,
                reason)
    return {TAG_STATUS: CANCELLED, TAG_BY: by or "unknown", TAG_REASON: reason,
            TAG_AT: now.isoformat(timespec="seconds")}


def _tag_version(request: dict[str, Any] | None, tags: dict[str, str], ti: Any) -> None:
    """Write ``tags`` (and the decision in the history tag) on the requested version; a failure
    is logged (the request is closed)."""
    if not request or not request.get("name") or not request.get("version"):
        log.warning("approval request of %s/%s closed, but its XCom %r names no model version: "
                    "its tags say pending still", ti.dag_id, ti.run_id, REQUEST_XCOM_KEY)
        return
    try:
        from trainforge.hooks.mlflow import MlflowHook
        from trainforge.hooks.mlflow_registry import ModelRegistry

        registry = ModelRegistry(MlflowHook(tracking_uri=request.get("tracking_uri")))
        found = registry.version(request["name"], str(request["version"])) or {}
        history = (found.get("tags") or {}).get(TAG_HISTORY)
        registry.set_version_tags(request["name"], str(request["version"]),
                                  with_history({**_asked(found), **tags}, history))
    except Exception:  # noqa: BLE001 - a listener must not fail the mark that fired it
        log.exception("approval request of %s v%s closed, but tagging the version failed",
                      request["name"], request["version"])


def _asked(found: dict[str, Any]) -> dict[str, str]:
    """The DAG run and try that asked, from the version's tags (kept in the history line)."""
    tags = found.get("tags") or {}
    return {key: tags[key] for key in (TAG_DAG_RUN, TAG_TRY) if key in tags}


def _waiting_downstream(session: Any, ti: Any) -> list[Any]:
    """The approval task instances of ``ti``'s DAG run that asked, with ``ti``'s task upstream
    of them (the ``upstream`` of their request XCom)."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    rows = session.scalars(select(XComModel).where(
        XComModel.dag_id == ti.dag_id, XComModel.run_id == ti.run_id,
        XComModel.key == REQUEST_XCOM_KEY, XComModel.task_id != ti.task_id)).all()
    found = []
    for row in rows:
        value = XComModel.deserialize_value(row)
        if isinstance(value, dict) and ti.task_id in (value.get("upstream") or []):
            found += session.scalars(select(TaskInstance).where(
                TaskInstance.dag_id == ti.dag_id, TaskInstance.run_id == ti.run_id,
                TaskInstance.task_id == row.task_id,
                TaskInstance.map_index == row.map_index)).all()
    return found


def _close_for(session: Any, task_instance: Any, state: str
               ) -> list[tuple[dict[str, Any] | None, dict[str, str], Any]]:
    """(request XCom, tags, approval task instance) of each request the mark closed."""
    if _is_ours(task_instance):
        approvals, marked = [task_instance], None
    elif state == "failed":
        approvals, marked = _waiting_downstream(session, task_instance), task_instance.task_id
    else:
        return []
    closed = []
    for ti in approvals:
        tags = close_request(session, ti, state, marked)
        if tags is not None:
            closed.append((_request_xcom(session, ti), tags, ti))
    return closed


def _on_end(task_instance: Any, state: str) -> None:
    if not _is_row(task_instance):
        return
    from sqlalchemy.orm import object_session

    try:
        session = object_session(task_instance)
        if session is not None:  # the marking request's transaction: closed as it commits
            closed = _close_for(session, task_instance, state)
        else:
            from airflow.utils.session import create_session

            with create_session() as own:
                closed = _close_for(own, task_instance, state)
        for request, tags, ti in closed:
            _tag_version(request, tags, ti)
    except Exception:  # noqa: BLE001 - a listener must not fail the mark that fired it
        log.exception("closing the approval request of %s/%s failed", task_instance.dag_id,
                      task_instance.run_id)


@hookimpl
def on_task_instance_failed(previous_state: Any, task_instance: Any, error: Any) -> None:
    """Close the request of an ``approve_champion`` task marked (or made) failed, or of one
    waiting downstream of a task marked failed."""
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
