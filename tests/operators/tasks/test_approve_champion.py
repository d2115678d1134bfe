"""approve_champion against a real MLflow server on loopback: what each answer does to the
registry, resumed as Airflow resumes it (``execute_complete`` with the event the API server or
the scheduler's timeout sweep builds), and the checks ``execute`` makes before asking.

The operator runs outside Airflow's DB: its context is a small fake task instance. Versions are
registered straight through MLflow's client (no model files: the task never loads them).
tests/faults/test_approval_rest.py answers a real request through Airflow's REST API.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import pytest
from airflow.providers.standard.exceptions import HITLTimeoutError
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from trainforge.approval import APPROVE, REJECT
from trainforge.pipeline.loader import load_spec
from trainforge.tasks.approve_champion import ApproveChampionOperator
from trainforge.tasks.register_model import champion_outlet, model_asset_name

pytestmark = pytest.mark.integration

SPEC = Path(__file__).resolve().parents[2] / "faults" / "fault_tiny.yaml"
ALICE = {"id": "alice", "name": "alice"}


class FakeTI:
    def __init__(self, xcoms: dict[str, Any], states: dict[str, str] | None = None) -> None:
        self.dag_id, self.run_id, self.task_id = "fault_tiny", "manual__a1", "approve_champion"
        self.try_number, self.xcoms, self.id = 1, xcoms, "ti-1"
        self.states = states or {}  # the DAG run's task states Airflow would return

    def get_task_states(self, dag_id: str, run_ids: list[str]) -> dict[str, Any]:
        assert (dag_id, run_ids) == (self.dag_id, [self.run_id])
        return {self.run_id: dict(self.states)}

    def xcom_pull(self, task_ids: str, key: str = "return_value") -> Any:
        return self.xcoms.get(task_ids)

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[(self.task_id, key)] = value


@pytest.fixture
def registry(mlflow_server):
    """A fresh registered model with v1 (champion) and v2 (the gate passed it)."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    name = f"approve-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(name)
    for _ in range(2):
        client.create_model_version(name, source="s3://nowhere/model")
    client.set_registered_model_alias(name, "champion", "1")
    for key, value in ASKED.items():  # what execute writes when it asks (FakeTI's run, try 1)
        client.set_model_version_tag(name, "2", key, value)
    return client, name


ASKED = {"trainforge.approval.status": "pending", "trainforge.approval.dag_run":
         "fault_tiny/manual__a1", "trainforge.approval.try": "1"}
UPSTREAM_OK = {"validate_checkpoint": "success", "register_model": "success"}


def _operator(server: str, name: str, on_timeout: str = "reject") -> ApproveChampionOperator:
    """The operator in a DAG whose approval follows validate_checkpoint >> register_model."""
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG

    raw = load_spec(SPEC).model_dump(mode="json")
    raw["registry"].update(model_name=name, approval={"on_timeout": on_timeout})
    with DAG("fault_tiny", schedule=None):
        task = ApproveChampionOperator(task_id="approve_champion", spec=raw, approvers=["alice"],
                                       timeout_s=3600, on_timeout=on_timeout,
                                       mlflow_tracking_uri=server,
                                       outlets=[champion_outlet(name)])
        EmptyOperator(task_id="validate_checkpoint") >> EmptyOperator(
            task_id="register_model") >> task
    return task


def _context(name: str, version: str = "2", states: dict[str, str] | None = None,
             **gate: Any) -> dict[str, Any]:
    from airflow.sdk.execution_time.context import OutletEventAccessors

    decision = {"decision": "pass", "candidate_version": version, "champion_version": "1",
                "champion_after": "1", "reason": "better", "metric": "val_bits_per_byte",
                **gate}
    ti = FakeTI({"register_model": {"name": name, "version": version, "gate": decision}},
                UPSTREAM_OK if states is None else states)
    return {"ti": ti, "params": {}, "outlet_events": OutletEventAccessors()}


def _answer(option: str, reason: str = "", by: dict | None = ALICE, timedout: bool = False):
    return {"chosen_options": [option], "params_input": {"reason": reason},
            "responded_at": dt.datetime(2026, 12, 1, 10, tzinfo=dt.timezone.utc),
            "responded_by_user": by, "timedout": timedout}


def _events(context, name):
    return context["outlet_events"][champion_outlet(name)].asset_alias_events


def test_approve_moves_champion_and_emits_the_asset_event(registry, mlflow_server):
    client, name = registry
    context = _context(name)
    result = _operator(mlflow_server, name).execute_complete(context, _answer(APPROVE, "ok"))
    assert (result["status"], result["by"], result["promoted"]) == ("approved", "alice", True)
    assert result["champion_after"] == "2"
    assert client.get_registered_model(name).aliases == {"champion": "2"}
    tags = client.get_model_version(name, "2").tags
    assert tags["trainforge.approval.status"] == "approved"
    assert tags["trainforge.approval.by"] == "alice" and tags["trainforge.approval.reason"] == "ok"
    assert tags["trainforge.previous_champion"] == "1"
    assert client.get_model_version(name, "1").tags["trainforge.superseded_by"] == "2"
    [event] = _events(context, name)
    assert event.dest_asset_key.name == model_asset_name(name)
    assert event.extra == {"name": name, "version": "2", "alias": "champion",
                           "model_uri": f"models:/{name}/2", "previous_champion": "1"}


def test_reject_tags_the_reason_and_keeps_the_champion(registry, mlflow_server):
    client, name = registry
    context = _context(name)
    result = _operator(mlflow_server, name).execute_complete(
        context, _answer(REJECT, "worse on dialogue"))
    assert (result["status"], result["promoted"], result["champion_after"]) == (
        "rejected", False, "1")
    assert client.get_registered_model(name).aliases == {"champion": "1"}
    tags = client.get_model_version(name, "2").tags
    assert tags["trainforge.approval.status"] == "rejected"
    assert tags["trainforge.approval.reason"] == "worse on dialogue"
    assert _events(context, name) == []


def test_a_timeout_with_on_timeout_reject_rejects(registry, mlflow_server):
    client, name = registry
    # What the scheduler's sweep resumes with: the default (Reject), nobody as responder.
    result = _operator(mlflow_server, name).execute_complete(
        _context(name), _answer(REJECT, by=None, timedout=True))
    assert (result["status"], result["by"], result["timed_out"]) == ("rejected", None, True)
    tags = client.get_model_version(name, "2").tags
    assert tags["trainforge.approval.by"] == "none"
    assert "no answer within 1h" in tags["trainforge.approval.reason"]
    assert client.get_registered_model(name).aliases == {"champion": "1"}


def test_a_timeout_with_on_timeout_fail_fails_the_task(registry, mlflow_server):
    client, name = registry
    event = {"error": "The Human-in-the-loop response timeout has passed without a response.",
             "error_type": "timeout"}
    with pytest.raises(HITLTimeoutError):
        _operator(mlflow_server, name, "fail").execute_complete(_context(name), event)
    assert client.get_model_version(name, "2").tags["trainforge.approval.status"] == "timed_out"
    assert client.get_registered_model(name).aliases == {"champion": "1"}


def test_a_timeout_with_on_timeout_fail_closes_the_request(registry, mlflow_server,
                                                           monkeypatch):
    """Answered Reject by nobody through the execution API, so a late answer gets a 409."""
    from airflow.sdk.execution_time import hitl

    client, name = registry
    closed = []
    monkeypatch.setattr(hitl, "update_hitl_detail_response",
                        lambda **answer: closed.append(answer))
    event = {"error": "no response", "error_type": "timeout"}
    with pytest.raises(HITLTimeoutError):
        _operator(mlflow_server, name, "fail").execute_complete(_context(name), event)
    [answer] = closed
    assert (answer["ti_id"], answer["chosen_options"]) == ("ti-1", [REJECT])
    assert answer["params_input"]["reason"].startswith("timed out: no answer within 1h ")
    tags = client.get_model_version(name, "2").tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"]) == (
        "timed_out", "none")
    assert tags["trainforge.approval.reason"] == answer["params_input"]["reason"]


def test_an_approved_version_that_disappeared_fails_the_task(registry, mlflow_server):
    client, name = registry
    client.delete_model_version(name, "2")
    with pytest.raises(AirflowFailException, match=f"{name} v2 no longer exists"):
        _operator(mlflow_server, name).execute_complete(_context(name), _answer(APPROVE))
    assert client.get_registered_model(name).aliases == {"champion": "1"}


def test_a_version_that_disappeared_before_the_request_fails_the_task(registry, mlflow_server):
    client, name = registry
    client.delete_model_version(name, "2")
    with pytest.raises(AirflowFailException, match="no longer exists"):
        _operator(mlflow_server, name).execute(_context(name))


def test_approve_after_champion_moved_elsewhere_moves_nothing(registry, mlflow_server):
    client, name = registry
    client.create_model_version(name, source="s3://nowhere/model")  # v3
    client.set_registered_model_alias(name, "champion", "3")
    with pytest.raises(AirflowFailException, match="moved from v1 to v3 since the eval gate"):
        _operator(mlflow_server, name).execute_complete(_context(name), _answer(APPROVE))
    assert client.get_registered_model(name).aliases == {"champion": "3"}
    assert client.get_model_version(name, "2").tags["trainforge.approval.status"] == "pending"


@pytest.mark.parametrize(("gate", "fragment"), [
    ({"decision": "fail"}, "eval gate fail"),
    ({"decision": "skipped"}, "eval gate skipped"),
    ({"champion_after": "2"}, "already holds champion"),  # a retry after the alias moved
])
def test_nothing_to_approve_skips_the_task(registry, mlflow_server, gate, fragment):
    client, name = registry
    with pytest.raises(AirflowSkipException, match=fragment):
        _operator(mlflow_server, name).execute(_context(name, **gate))
    assert client.get_model_version(name, "2").tags == ASKED  # not asked: nothing rewritten


def test_asking_resets_the_tags_and_names_the_version_for_the_listener(registry, mlflow_server,
                                                                      monkeypatch):
    """A re-asked request (after a reject or a cancel) says pending, not the old who and why;
    the XCom tells trainforge.approval.close which version to tag if the task is marked."""
    from airflow.providers.standard.operators import hitl
    from airflow.sdk.exceptions import TaskAwaitingInput

    client, name = registry
    client.set_model_version_tag(name, "2", "trainforge.approval.by", "admin")
    client.set_model_version_tag(name, "2", "trainforge.approval.reason", "cancelled: marked")
    posted = []
    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **request: posted.append(request))
    context = _context(name)
    context["task_instance"] = context["ti"]
    with pytest.raises(TaskAwaitingInput) as parked:
        _operator(mlflow_server, name).execute(context)
    assert parked.value.timeout == dt.timedelta(hours=1)
    assert [p["subject"] for p in posted] == [f"Promote {name} v2 to champion?"]
    tags = client.get_model_version(name, "2").tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"],
            tags["trainforge.approval.reason"]) == ("pending", "none", "none")
    assert context["ti"].xcoms[("approve_champion", "trainforge_approval_request")] == {
        "name": name, "version": "2", "tracking_uri": mlflow_server,
        "upstream": ["register_model", "validate_checkpoint"]}


def test_approve_records_the_decision_in_the_history(registry, mlflow_server):
    client, name = registry
    _operator(mlflow_server, name).execute_complete(_context(name), _answer(APPROVE, "ok"))
    [line] = client.get_model_version(name, "2").tags["trainforge.approval.history"].splitlines()
    assert line == "2026-12-01T10:00:00+00:00 approved by alice in fault_tiny/manual__a1 try 1: ok"


@pytest.mark.parametrize("state", ["failed", "upstream_failed", "running"])
def test_approve_with_validation_not_success_in_this_run_moves_nothing(registry, mlflow_server,
                                                                      state):
    """validate_checkpoint marked failed after the answer was given: read at the move."""
    client, name = registry
    context = _context(name, states={**UPSTREAM_OK, "validate_checkpoint": state})
    with pytest.raises(AirflowFailException, match=f"validate_checkpoint is {state} in this DAG"):
        _operator(mlflow_server, name).execute_complete(context, _answer(APPROVE))
    assert client.get_registered_model(name).aliases == {"champion": "1"}
    tags = client.get_model_version(name, "2").tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"]) == (
        "cancelled", "unknown")
    assert f"validate_checkpoint is {state}" in tags["trainforge.approval.reason"]
    assert "approved by alice" in tags["trainforge.approval.reason"]
    assert " cancelled by unknown " in tags["trainforge.approval.history"]
    assert _events(context, name) == []


def test_approve_of_another_trys_request_moves_nothing(registry, mlflow_server):
    client, name = registry
    client.set_model_version_tag(name, "2", "trainforge.approval.try", "2")  # asked again since
    with pytest.raises(AirflowFailException, match="not pending for fault_tiny/manual__a1 try 1"):
        _operator(mlflow_server, name).execute_complete(_context(name), _answer(APPROVE))
    assert client.get_registered_model(name).aliases == {"champion": "1"}
    assert client.get_model_version(name, "2").tags["trainforge.approval.status"] == "pending"


def test_a_request_closed_without_an_answer_fails_and_keeps_the_cancel(registry, mlflow_server):
    """What the listener's close of the request resumes the task with."""
    client, name = registry
    client.set_model_version_tag(name, "2", "trainforge.approval.status", "cancelled")
    closed = _answer(REJECT, "cancelled: validate_checkpoint was marked failed by admin",
                     by={"id": "trainforge", "name": "trainforge (closed)"})
    with pytest.raises(AirflowFailException, match="closed without an answer .cancelled: "
                                                   "validate_checkpoint was marked failed"):
        _operator(mlflow_server, name).execute_complete(_context(name), closed)
    assert client.get_model_version(name, "2").tags["trainforge.approval.status"] == "cancelled"
    assert client.get_registered_model(name).aliases == {"champion": "1"}


def test_the_champion_version_is_skipped_and_keeps_its_decision(registry, mlflow_server):
    """A cleared approval after an Approve: register_model's XCom still names the old champion."""
    client, name = registry
    _operator(mlflow_server, name).execute_complete(_context(name), _answer(APPROVE, "ok"))
    with pytest.raises(AirflowSkipException, match="v2 already holds champion: nothing to "
                                                   "approve .its approval status stays approved"):
        _operator(mlflow_server, name).execute(_context(name))
    tags = client.get_model_version(name, "2").tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"]) == (
        "approved", "alice")
    assert client.get_registered_model(name).aliases == {"champion": "2"}


def test_reject_of_a_version_that_became_champion_meanwhile_keeps_its_decision(registry,
                                                                            mlflow_server):
    client, name = registry
    client.set_registered_model_alias(name, "champion", "2")
    with pytest.raises(AirflowFailException, match="became champion while this request waited"):
        _operator(mlflow_server, name).execute_complete(_context(name), _answer(REJECT, "no"))
    assert client.get_model_version(name, "2").tags["trainforge.approval.status"] == "pending"
    assert client.get_registered_model(name).aliases == {"champion": "2"}
