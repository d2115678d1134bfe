"""Human approval under a real ``airflow standalone``, answered through Airflow's REST API the
way a script (or the UI's required-actions page) answers it. One run of ``approval_tiny``
(registry.approval, approver ``admin``):

* the request shows what a person reads: the gate's report in the body, the spec's approver as
  the assigned user; the version waits tagged ``pending``;
* rejected with a reason: the version is tagged rejected, champion stays unset, no asset event,
  the DAG run succeeds;
* the approval task cleared (what the UI's "clear" does) asks again; approved: champion moves to
  the version and the model's asset event reaches Airflow with the version in its extra;
* the run waited past its ``pipeline.deadline`` (20 s): Airflow's deadline alert mailed the
  pipeline's recipients through ``smtp_default`` (the session's SMTP sink).

A run of ``approval_cancel`` (its own model, so its version passes the gate; with
``registry.approval.notify``): the request is mailed to the approvers; the approval task marked
failed while it waits closes the request (Airflow's ``response_received``), the version
says ``cancelled`` by ``admin``, and a late Approve is refused with 409; cleared, the task asks
again with a fresh request (a new ``created_at``), which an answer still ends.

An answer is sent only once the scheduler has seen the parked task's worker exit: Airflow
3.3.2 fails a task resumed so fast that it is already queued again when the scheduler
processes that exit (its resume-after-defer exception covers ``scheduled`` only), which a
person never is but a script answering within a second can be.
"""

from __future__ import annotations

import urllib.error
from email import message_from_string, policy
from email.message import EmailMessage
from urllib.parse import quote

import pytest
from faultlib import has_dag, wait_for, wait_run_end

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.heavy]

DAG = "approval_tiny"
MODEL = "approval-tiny"
CANCEL_DAG, CANCEL_MODEL = "approval_cancel", "approval-cancel"  # approval_cancel.yaml
TASK = "approve_champion"
REACH_APPROVAL_S = 600  # prepare_data, 10 steps of training, validation, export and register


def _hitl_path(run_id: str, dag: str = DAG) -> str:
    return f"/api/v2/dags/{dag}/dagRuns/{quote(run_id)}/taskInstances/{TASK}/-1/hitlDetails"


def _parks(server, run_id: str) -> int:
    """How often the scheduler has processed the exit of a worker that parked the task."""
    return sum(f"task_id={TASK}, run_id={run_id}," in line and "state=awaiting_input" in line
               for line in server.log_path.read_text(errors="replace").splitlines()
               if "TaskInstance Finished" in line)


def _ask(server, run_id: str, times: int, dag: str = DAG) -> dict:
    """The request of ``run_id`` once its task waits for the ``times``-th answer."""
    def asked():
        try:
            state = server.ti(dag, run_id, TASK)["state"]
        except urllib.error.HTTPError:
            return None
        if state in ("failed", "skipped", "upstream_failed"):
            pytest.fail(f"{TASK} ended {state} before asking: {server.tail()}")
        return (state == "awaiting_input" and _parks(server, run_id) >= times
                and server.api("GET", _hitl_path(run_id, dag)))

    return wait_for(f"{TASK} of {run_id} to ask (#{times})", asked, REACH_APPROVAL_S, 2)


def _answer(server, run_id: str, option: str, reason: str, dag: str = DAG) -> dict:
    return server.api("PATCH", _hitl_path(run_id, dag),
                      {"chosen_options": [option], "params_input": {"reason": reason}})


def _asset_events(server) -> list[dict]:
    assets = server.api("GET", f"/api/v2/assets?name_pattern=trainforge-model-{MODEL}")["assets"]
    if not assets:
        return []
    return server.api("GET", f"/api/v2/assets/events?asset_id={assets[0]['id']}")["asset_events"]


def _overdue_mails(sink, run_id: str) -> list[EmailMessage]:
    mails = [message_from_string(m, policy=policy.default) for m in sink.messages]
    return [m for m in mails if m["Subject"] == f"trainforge {DAG}: run {run_id} overdue (20s)"]


def _request_mails(sink, version: str) -> list[EmailMessage]:
    mails = [message_from_string(m, policy=policy.default) for m in sink.messages]
    return [m for m in mails
            if m["Subject"] == f"Promote {CANCEL_MODEL} v{version} to champion?"]


def test_reject_then_approve_through_the_rest_api(airflow_standalone, mlflow_server, smtp_sink):
    from mlflow import MlflowClient

    server, client = airflow_standalone, MlflowClient(mlflow_server)
    wait_for(f"the {DAG} DAG", lambda: has_dag(server, DAG), 120, 2)

    run_id = server.trigger(DAG)
    request = _ask(server, run_id, 1)
    version = request["subject"].split(" v")[1].split(" ")[0]
    assert request["subject"] == f"Promote {MODEL} v{version} to champion?"
    assert request["options"] == ["Approve", "Reject"]
    assert [u["id"] for u in request["assigned_users"]] == ["admin"]
    body = request["body"]
    assert f"| candidate | v{version} |" in body and "| champion | — | — |" in body
    assert "**Thresholds**" in body and "`validation.gate.metric`: val_bits_per_byte" in body
    assert "**Model card**" in body and f"> # {MODEL}" in body
    assert f"/#/models/{MODEL}/versions/{version}" in body
    assert client.get_model_version(MODEL, version).tags["trainforge.approval.status"] == "pending"

    answered = _answer(server, run_id, "Reject", "samples read worse than the champion's")
    assert answered["responded_by"]["id"] == "admin"
    assert wait_run_end(server, DAG, run_id, 300) == "success", server.tail()
    assert server.ti(DAG, run_id, TASK)["state"] == "success"
    tags = client.get_model_version(MODEL, version).tags
    assert tags["trainforge.approval.status"] == "rejected"
    assert tags["trainforge.approval.by"] == "admin"
    assert tags["trainforge.approval.reason"] == "samples read worse than the champion's"
    assert "champion" not in client.get_registered_model(MODEL).aliases
    assert _asset_events(server) == []

    server.clear(DAG, run_id, TASK)
    assert _ask(server, run_id, 2)["subject"] == request["subject"]
    _answer(server, run_id, "Approve", "")
    assert wait_run_end(server, DAG, run_id, 300) == "success", server.tail()
    assert client.get_registered_model(MODEL).aliases["champion"] == version
    tags = client.get_model_version(MODEL, version).tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"]) == (
        "approved", "admin")
    events = wait_for("the champion's asset event", lambda: _asset_events(server), 60, 2)
    assert [e["extra"]["version"] for e in events] == [version]
    assert events[0]["extra"]["model_uri"] == f"models:/{MODEL}/{version}"

    [mail] = wait_for("the overdue mail of the deadline alert",
                      lambda: _overdue_mails(smtp_sink, run_id), 120, 1)
    assert mail["To"] == "ml-platform@example.org"
    assert "is still running 20s after it was queued" in mail.get_body(("html",)).get_content()

    # Cleared after the Approve: the version holds champion, so nothing is asked and the
    # recorded decisions stay (#41: it used to ask again and tag the champion pending).
    server.clear(DAG, run_id, TASK)
    wait_for(f"{TASK} skipped", lambda: server.ti(DAG, run_id, TASK)["state"] == "skipped",
             300, 2)
    assert wait_run_end(server, DAG, run_id, 300) == "success", server.tail()
    tags = client.get_model_version(MODEL, version).tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"]) == (
        "approved", "admin")
    history = tags["trainforge.approval.history"].splitlines()
    assert [line.split(" ")[1:4] for line in history] == [
        ["rejected", "by", "admin"], ["approved", "by", "admin"]], history
    assert f"in {DAG}/{run_id} try 1: samples read worse" in history[0]
    assert client.get_registered_model(MODEL).aliases["champion"] == version


def test_marked_failed_while_waiting_closes_the_request(airflow_standalone, mlflow_server,
                                                         smtp_sink):
    from mlflow import MlflowClient

    server, client = airflow_standalone, MlflowClient(mlflow_server)
    wait_for(f"the {CANCEL_DAG} DAG", lambda: has_dag(server, CANCEL_DAG), 120, 2)

    run_id = server.trigger(CANCEL_DAG)
    request = _ask(server, run_id, 1, CANCEL_DAG)
    version = request["subject"].split(" v")[1].split(" ")[0]
    [mail] = wait_for("the request mailed to the approvers",
                      lambda: _request_mails(smtp_sink, version), 60, 1)
    assert mail["To"] == "approvers@example.org"
    html = mail.get_body(("html",)).get_content()
    assert f"| candidate | v{version} |" in html and "/required_actions" in html

    server.set_state(CANCEL_DAG, run_id, TASK, "failed")
    closed = server.api("GET", _hitl_path(run_id, CANCEL_DAG))
    assert closed["response_received"] is True, closed
    assert closed["responded_by_user"]["id"] == "trainforge"
    assert "the task was marked failed by admin" in closed["params_input"]["reason"]
    tags = client.get_model_version(CANCEL_MODEL, version).tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"]) == (
        "cancelled", "admin")
    assert "the task was marked failed by admin" in tags["trainforge.approval.reason"]
    with pytest.raises(urllib.error.HTTPError) as late:
        _answer(server, run_id, "Approve", "too late", CANCEL_DAG)
    assert late.value.code == 409
    assert wait_run_end(server, CANCEL_DAG, run_id, 300) == "failed", server.tail()
    assert "champion" not in client.get_registered_model(CANCEL_MODEL).aliases
    assert client.get_model_version(CANCEL_MODEL, version).tags["trainforge.approval.status"] == (
        "cancelled")

    server.clear(CANCEL_DAG, run_id, TASK)
    again = _ask(server, run_id, 2, CANCEL_DAG)
    assert again["response_received"] is False
    assert again["created_at"] > request["created_at"], (request, again)
    tags = client.get_model_version(CANCEL_MODEL, version).tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"]) == (
        "pending", "none")
    _answer(server, run_id, "Reject", "asked again, rejected", CANCEL_DAG)
    assert wait_run_end(server, CANCEL_DAG, run_id, 300) == "success", server.tail()
    tags = client.get_model_version(CANCEL_MODEL, version).tags
    assert tags["trainforge.approval.status"] == "rejected"
    assert [line.split(" ")[1:4] for line in tags["trainforge.approval.history"].splitlines()] == [
        ["cancelled", "by", "admin"], ["rejected", "by", "admin"]]
    assert "champion" not in client.get_registered_model(CANCEL_MODEL).aliases


def _tries_path(run_id: str, try_number: int) -> str:
    return _hitl_path(run_id, CANCEL_DAG) + f"/tries/{try_number}"


def test_validation_marked_failed_while_waiting_cancels_the_approval(airflow_standalone,
                                                                     mlflow_server):
    """#41: validate_checkpoint marked failed (plain "mark failed") while the approval waits
    closes the request, tags the version cancelled and fails the run; asked again, an Approve
    still moves nothing, read from the run's task states at the move."""
    from mlflow import MlflowClient

    server, client = airflow_standalone, MlflowClient(mlflow_server)
    wait_for(f"the {CANCEL_DAG} DAG", lambda: has_dag(server, CANCEL_DAG), 120, 2)
    run_id = server.trigger(CANCEL_DAG)
    version = _ask(server, run_id, 1, CANCEL_DAG)["subject"].split(" v")[1].split(" ")[0]

    server.set_state(CANCEL_DAG, run_id, "validate_checkpoint", "failed")
    closed = server.api("GET", _hitl_path(run_id, CANCEL_DAG))
    assert closed["response_received"] is True, closed
    assert closed["responded_by_user"]["id"] == "trainforge"
    reason = "cancelled: validate_checkpoint was marked failed by admin before anyone answered"
    assert closed["params_input"]["reason"] == reason
    tags = client.get_model_version(CANCEL_MODEL, version).tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"],
            tags["trainforge.approval.reason"]) == ("cancelled", "admin", reason)
    with pytest.raises(urllib.error.HTTPError) as late:
        _answer(server, run_id, "Approve", "too late", CANCEL_DAG)
    assert late.value.code == 409
    assert wait_run_end(server, CANCEL_DAG, run_id, 300) == "failed", server.tail()
    assert server.ti(CANCEL_DAG, run_id, TASK)["state"] == "failed"
    assert "champion" not in client.get_registered_model(CANCEL_MODEL).aliases

    # Cleared, the approval asks again (the version is not champion); an Approve is refused at
    # the move because validate_checkpoint of this run is failed.
    server.clear(CANCEL_DAG, run_id, TASK)
    _ask(server, run_id, 2, CANCEL_DAG)
    _answer(server, run_id, "Approve", "approved anyway", CANCEL_DAG)
    assert wait_run_end(server, CANCEL_DAG, run_id, 300) == "failed", server.tail()
    assert "champion" not in client.get_registered_model(CANCEL_MODEL).aliases
    tags = client.get_model_version(CANCEL_MODEL, version).tags
    assert tags["trainforge.approval.status"] == "cancelled"
    assert "validate_checkpoint is failed in this DAG run" in tags["trainforge.approval.reason"]
    assert "approved by admin" in tags["trainforge.approval.reason"]


def test_validation_marked_failed_with_downstream_cancels_the_approval(airflow_standalone,
                                                                       mlflow_server):
    """#41: marked failed with its downstream tasks, the approval is cleared by Airflow in the
    same mark: its request, now in the try history, is closed and the version tagged
    cancelled (it used to stay pending for ever)."""
    from mlflow import MlflowClient

    server, client = airflow_standalone, MlflowClient(mlflow_server)
    wait_for(f"the {CANCEL_DAG} DAG", lambda: has_dag(server, CANCEL_DAG), 120, 2)
    run_id = server.trigger(CANCEL_DAG)
    version = _ask(server, run_id, 1, CANCEL_DAG)["subject"].split(" v")[1].split(" ")[0]

    server.set_state(CANCEL_DAG, run_id, "validate_checkpoint", "failed", downstream=True)
    closed = server.api("GET", _tries_path(run_id, 1))
    assert closed["response_received"] is True, closed
    assert closed["responded_by_user"]["id"] == "trainforge"
    reason = ("cancelled: validate_checkpoint was marked failed with its downstream tasks by "
              "admin before anyone answered")
    assert closed["params_input"]["reason"] == reason
    tags = client.get_model_version(CANCEL_MODEL, version).tags
    assert (tags["trainforge.approval.status"], tags["trainforge.approval.by"],
            tags["trainforge.approval.reason"]) == ("cancelled", "admin", reason)
    with pytest.raises(urllib.error.HTTPError) as late:
        _answer(server, run_id, "Approve", "too late", CANCEL_DAG)
    assert late.value.code in (404, 409)
    assert wait_run_end(server, CANCEL_DAG, run_id, 300) == "failed", server.tail()
    assert "champion" not in client.get_registered_model(CANCEL_MODEL).aliases
    assert client.get_model_version(CANCEL_MODEL, version).tags[
        "trainforge.approval.status"] == "cancelled"
