"""The listener that closes an approval request whose task ended without an answer
(trainforge.approval_close), on Airflow's own ``hitl_detail`` and ``log`` tables in SQLite:
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

from trainforge import approval_close


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
