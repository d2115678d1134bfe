"""The DAG of a spec with ``registry.approval`` and ``pipeline.deadline``: the approval task
between ``register_model`` and the teardown, the champion's asset outlet on it, and the deadline
alert mailing the pipeline's recipients. Without both blocks the DAG is as before
(tests/operators/test_dag_builder.py)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from airflow.sdk import DeadlineReference

from trainforge.dag_builder import build_dag
from trainforge.graph import TaskKind, task_graph
from trainforge.pipeline import parse_spec_text
from trainforge.tasks.approve_champion import ApproveChampionOperator

BASE = (Path(__file__).resolve().parents[1] / "faults" / "fault_tiny.yaml").read_text()
APPROVAL = "  approval:\n    approvers: [alice, bob]\n    timeout: 2h\n"
DEADLINE = ("  deadline: 45m\n  notifications:\n    email:\n"
            "      to: [ml-platform@example.org, oncall@example.org]\n")


def _spec(approval: str = APPROVAL, pipeline: str = ""):
    text = BASE.replace("  aliases: [challenger]\n", "  aliases: [challenger]\n" + approval)
    return parse_spec_text(text.replace("  schedule: null\n", "  schedule: null\n" + pipeline),
                           "p.yaml")


def test_approval_sits_between_register_model_and_the_teardown():
    spec = _spec()
    graph = task_graph(spec)
    assert graph.task_ids == ["prepare_data", "train", "validate_checkpoint", "register_model",
                              "approve_champion", "close_run"]
    assert graph.node("approve_champion").kind is TaskKind.APPROVE_CHAMPION
    assert graph.node("approve_champion").upstream == ("register_model",)
    assert "approve_champion" in graph.teardown.upstream
    dag = build_dag(spec, "p.yaml")
    assert dag.get_task("approve_champion").upstream_task_ids == {"register_model"}
    assert "approve_champion" in dag.get_task("close_run").upstream_task_ids


def test_the_approval_task_asks_the_spec_approvers_and_defaults_to_reject():
    dag = build_dag(_spec(), "p.yaml")
    task = dag.get_task("approve_champion")
    assert isinstance(task, ApproveChampionOperator)
    assert task.options == ["Approve", "Reject"] and task.multiple is False
    assert task.assigned_users == [{"id": "alice", "name": "alice"},
                                   {"id": "bob", "name": "bob"}]
    assert task.response_timeout == dt.timedelta(hours=2)
    assert task.defaults == ["Reject"]  # what Airflow applies when nobody answers in time
    assert list(task.params) == ["reason"]  # the DAG's trigger params stay out of the form


def test_on_timeout_fail_has_no_default_and_no_approvers_assigns_nobody():
    task = build_dag(_spec("  approval:\n    on_timeout: fail\n"), "p.yaml").get_task(
        "approve_champion")
    assert task.defaults is None and task.assigned_users is None
    assert task.response_timeout == dt.timedelta(days=7)


def test_the_champion_outlet_moves_to_the_approval_task():
    dag = build_dag(_spec(), "p.yaml")
    assert dag.get_task("register_model").outlets == []
    assert [o.name for o in dag.get_task("approve_champion").outlets] == [
        "trainforge-model-fault-tiny-champion"]
    plain = build_dag(_spec(approval=""), "p.yaml")
    assert [o.name for o in plain.get_task("register_model").outlets] == [
        "trainforge-model-fault-tiny-champion"]
    assert "approve_champion" not in plain.task_ids and plain.deadline is None


def test_the_deadline_mails_the_pipeline_recipients_after_the_run_is_queued():
    dag = build_dag(_spec(pipeline=DEADLINE), "p.yaml")
    [alert] = dag.deadline
    assert alert.reference == DeadlineReference.DAGRUN_QUEUED_AT
    assert alert.interval == dt.timedelta(minutes=45)
    assert alert.callback.path == "airflow.providers.smtp.notifications.smtp.SmtpNotifier"
    kwargs = alert.callback.kwargs
    assert kwargs["to"] == ["ml-platform@example.org", "oncall@example.org"]
    assert kwargs["subject"] == "trainforge fault_tiny: run {{ dag_run.dag_run_id }} overdue (45m)"
    assert "{{ deadline.deadline_time }}" in kwargs["html_content"]


def test_both_serialize_as_airflow_stores_them():
    from airflow.serialization.serialized_objects import DagSerialization

    dag = build_dag(_spec(pipeline=DEADLINE), "p.yaml")
    back = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    task = back.get_task("approve_champion")
    assert task.task_type == "ApproveChampionOperator"
    [stored] = back.deadline  # the scheduler's form: plain data
    assert stored["reference"] == {"reference_type": "DagRunQueuedAtDeadline"}
    assert stored["interval"]["__data__"] == 2700.0
    assert stored["callback"]["__data__"]["path"].endswith("smtp.SmtpNotifier")
