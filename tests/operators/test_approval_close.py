"""The listener that closes an approval request whose task ended without an answer
(trainforge.approval.close), on Airflow's own ``hitl_detail`` and ``log`` tables in SQLite:
an open request is closed (Reject, by ``trainforge``, the mark and who made it as the reason),
an answered one is left alone, and only approve_champion rows (not a worker's task instance)
are ours.
tests/faults/test_approval_rest.py does the same through a real Airflow.
"""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from airflow.models.hitl import HITLDetail
from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from trainforge.approval import close as approval_close


class FakeTI:
    """What the listener reads of a task instance row."""

    def __init__(self) -> None:
        self.id = uuid.uuid4()
        self.dag_id, self.run_id, self.task_id, self.map_index = "p", "r1", "approve_champion", -1


@pytest.fixture
def session():
    from airflow.models import import_all_models

    import_all_models()
    engine = create_engine("sqlite://")
    HITLDetail.metadata.create_all(engine)  # Airflow's tables, empty: no rows to join
    with Session(engine) as session:
        yield session


def _request(session, ti, **answer) -> HITLDetail:
    detail = HITLDetail(ti_id=ti.id, options=["Approve", "Reject"], subject="Promote m v2?",
                        params={}, **answer)
    session.add(detail)
    session.flush()
    return detail


def test_an_open_request_is_closed_with_who_marked_the_task(session):
    ti = FakeTI()
    detail = _request(session, ti)
    session.add(Log(event="patch_task_instance", owner="alice", dag_id="p", run_id="r1",
                    task_id="approve_champion"))
    session.flush()
    tags = approval_close.close_request(session, ti, "failed")
    assert detail.response_received and detail.chosen_options == ["Reject"]
    assert detail.responded_by["id"] == "trainforge"
    reason = "cancelled: the task was marked failed by alice before anyone answered"
    assert detail.params_input == {"reason": reason}
    assert tags["trainforge.approval.status"] == "cancelled"
    assert (tags["trainforge.approval.by"], tags["trainforge.approval.reason"]) == ("alice", reason)


def test_a_dag_run_mark_without_an_audit_entry_says_unknown(session):
    ti = FakeTI()
    _request(session, ti)
    tags = approval_close.close_request(session, ti, "success")
    assert tags["trainforge.approval.by"] == "unknown"
    assert "the task ended success without an answer" in tags["trainforge.approval.reason"]


def test_an_answered_request_is_left_alone(session):
    ti = FakeTI()
    at = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    detail = _request(session, ti, responded_at=at, chosen_options=["Approve"],
                      responded_by={"id": "bob", "name": "bob"})
    assert approval_close.close_request(session, ti, "failed") is None
    assert detail.chosen_options == ["Approve"] and detail.responded_by["id"] == "bob"
    assert approval_close.close_request(session, FakeTI(), "failed") is None  # never asked


def test_only_approve_champion_rows_are_closed():
    from sqlalchemy.orm.instrumentation import manager_of_class

    def row(operator: str) -> TaskInstance:  # a task instance row, without a task to build it
        ti = manager_of_class(TaskInstance).new_instance()
        ti.operator = operator
        return ti

    assert approval_close._is_ours(row(approval_close.OPERATOR))
    assert not approval_close._is_ours(row("PythonOperator"))
    worker_ti = FakeTI()  # a worker's Task SDK task instance: no database row to close
    worker_ti.operator = approval_close.OPERATOR
    assert not approval_close._is_ours(worker_ti)


def _mark(session, task_id: str, extra: str = "{}") -> None:
    session.add(Log(event="patch_task_instance", owner="admin", dag_id="p", run_id="r1",
                    task_id=task_id, extra=extra))
    session.flush()


@pytest.mark.parametrize(("extra", "what"), [
    ('{"new_state": "failed"}', "validate_checkpoint was marked failed by admin"),
    ('{"new_state": "failed", "include_downstream": true}',
     "validate_checkpoint was marked failed with its downstream tasks by admin"),
])
def test_an_upstream_mark_names_the_task_who_marked_it_and_how(session, extra, what):
    ti = FakeTI()
    _request(session, ti)
    _mark(session, "validate_checkpoint", extra)
    tags = approval_close.close_request(session, ti, "failed", "validate_checkpoint")
    assert tags["trainforge.approval.reason"] == f"cancelled: {what} before anyone answered"
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"]) == (
        "cancelled", "admin")


def test_an_upstream_mark_without_an_audit_entry_names_the_task_and_its_state(session):
    ti = FakeTI()
    _request(session, ti)
    tags = approval_close.close_request(session, ti, "failed", "validate_checkpoint")
    assert tags["trainforge.approval.reason"] == (
        "cancelled: validate_checkpoint ended failed before anyone answered")


def test_a_request_the_mark_moved_to_the_try_history_is_closed(session):
    """A mark with downstream tasks clears the approval in the same transaction: a new try id,
    the request copied to Airflow's request history."""
    from airflow.models.hitl_history import HITLDetailHistory
    from airflow.models.taskinstancehistory import TaskInstanceHistory

    old, ti = uuid.uuid4(), FakeTI()
    session.execute(TaskInstanceHistory.__table__.insert().values(
        task_instance_id=old, dag_id="p", run_id="r1", task_id="approve_champion", map_index=-1,
        try_number=1, pool="default_pool"))
    moved = HITLDetail(ti_id=old, options=["Approve", "Reject"], subject="Promote m v2?",
                       params={})
    session.add(HITLDetailHistory(moved))
    session.flush()
    _mark(session, "validate_checkpoint", '{"include_downstream": true}')
    tags = approval_close.close_request(session, ti, "failed")
    assert tags["trainforge.approval.status"] == "cancelled"
    [row] = session.query(HITLDetailHistory).all()
    assert row.responded_by["id"] == "trainforge" and row.chosen_options == ["Reject"]
    assert approval_close.close_request(session, ti, "failed") is None  # closed once


def test_a_failed_mark_upstream_closes_the_waiting_approval_and_nothing_else(session):
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel

    from airflow.models.dagrun import DagRun

    approval = uuid.uuid4()
    session.execute(DagRun.__table__.insert().values(
        id=1, dag_id="p", run_id="r1", run_type="manual", logical_date=None,
        data_interval_start=None, data_interval_end=None))
    session.execute(TaskInstance.__table__.insert().values(
        id=approval, dag_id="p", run_id="r1", task_id="approve_champion", map_index=-1,
        try_number=1, pool="default_pool", operator=approval_close.OPERATOR,
        state="awaiting_input", next_method="execute_complete"))
    session.add(XComModel(dag_run_id=1, dag_id="p", run_id="r1", task_id="approve_champion",
                          map_index=-1, key=approval_close.REQUEST_XCOM_KEY,
                          value=XComModel.serialize_value(
                              {"name": "m", "version": "2", "tracking_uri": "http://x",
                               "upstream": ["register_model", "validate_checkpoint"]})))
    ours = FakeTI()
    ours.id = approval
    detail = _request(session, ours)
    marked = FakeTI()
    for task_id, state in [("close_run", "failed"), ("validate_checkpoint", "success")]:
        marked.task_id = task_id  # not upstream / not failed: the approval keeps waiting
        assert approval_close._close_for(session, marked, state) == []
    assert detail.responded_at is None
    marked.task_id = "validate_checkpoint"
    [(request, tags, ti)] = approval_close._close_for(session, marked, "failed")
    assert (request["name"], request["version"], ti.id) == ("m", "2", approval)
    assert tags["trainforge.approval.reason"] == (
        "cancelled: validate_checkpoint ended failed before anyone answered")
    assert detail.response_received and detail.responded_by["id"] == "trainforge"
    # resumed as an answer resumes it, so the task runs and fails on the closed request
    assert ti.state == "scheduled" and ti.next_kwargs["event"]["responded_by_user"]["id"] == (
        "trainforge")
