"""Human approval of a gate pass (``registry.approval``, docs/registry.md): the request a person
reads, the tags that record the answer, and what each answer means. Pure: no Airflow, no MLflow.

The ``approve_champion`` task (trainforge.tasks.approve_champion) asks; a person answers
``Approve`` or ``Reject`` (with an optional reason) in the Airflow UI's required actions or
through the REST API; this module turns the answer into an :class:`ApprovalOutcome`.
Beside it: :mod:`~trainforge.approval.notify` sends the posted request to approvers, and
:mod:`~trainforge.approval.close` (the plugin's listener) closes one whose task ended unanswered.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trainforge.pipeline.durations import format_duration

APPROVE, REJECT = "Approve", "Reject"  # the options (the names ApprovalOperator uses)
REASON_PARAM = "reason"  # the request's one form field

APPROVAL_TAG_PREFIX = "trainforge.approval."
# PENDING | APPROVED | REJECTED | TIMED_OUT | CANCELLED
TAG_STATUS = APPROVAL_TAG_PREFIX + "status"
# the answering Airflow user id; "none" on a timeout; on a cancel who marked the task ("unknown")
TAG_BY = APPROVAL_TAG_PREFIX + "by"
TAG_REASON = APPROVAL_TAG_PREFIX + "reason"  # the approver's reason, the timeout's or the cancel's
TAG_AT = APPROVAL_TAG_PREFIX + "at"  # ISO 8601 UTC time of the request or the answer
TAG_DAG_RUN = APPROVAL_TAG_PREFIX + "dag_run"  # "<dag_id>/<run_id>" that asked
TAG_TRY = APPROVAL_TAG_PREFIX + "try"  # the try number of approve_champion that asked
TAG_HISTORY = APPROVAL_TAG_PREFIX + "history"  # one line per decision, oldest first
PENDING, APPROVED, REJECTED, TIMED_OUT = "pending", "approved", "rejected", "timed_out"
CANCELLED = "cancelled"  # the task ended without an answer (trainforge.approval.close)
DECISIONS = (APPROVED, REJECTED, TIMED_OUT, CANCELLED)  # statuses that end a request
CLOSED_BY_ID = "trainforge"  # responded_by.id of a request closed without an answer
HISTORY_MAX_CHARS = 5000  # MLflow's longest model version tag value; the oldest lines go first


@dataclass(frozen=True)
class ApprovalOutcome:
    """What an answer (or its absence) decides for one model version."""

    status: str  # APPROVED | REJECTED
    by: str | None  # Airflow user id; None when the request timed out
    reason: str
    at: str  # ISO 8601 UTC
    timed_out: bool = False

    @property
    def promote(self) -> bool:
        return self.status == APPROVED

    def tags(self) -> dict[str, str]:
        return {TAG_STATUS: self.status, TAG_BY: self.by or "none",
                TAG_REASON: self.reason or "none", TAG_AT: self.at}

    def as_xcom(self) -> dict[str, Any]:
        return {**asdict(self), "promoted": self.promote}


def outcome_of(chosen: list[str], params_input: dict[str, Any], responded_by: dict | None,
               responded_at: str, timed_out: bool, timeout_s: int) -> ApprovalOutcome:
    """The outcome of a resumed request.

    Args:
        chosen: the chosen options (one of :data:`APPROVE`, :data:`REJECT`).
        params_input: the form's values (``{"reason": text}``).
        responded_by: Airflow's ``{"id", "name"}`` of who answered; None on a timeout.
        timed_out: Airflow applied the request's default (``Reject``) because nobody answered.
    Raises:
        ValueError: not exactly one known option (Airflow validated the answer first, so a
            programming error).
    """
    if len(chosen) != 1 or chosen[0] not in (APPROVE, REJECT):
        raise ValueError(f"an approval answer is one of {APPROVE!r}, {REJECT!r} (got {chosen!r})")
    reason = str(params_input.get(REASON_PARAM) or "").strip()
    if timed_out:
        return ApprovalOutcome(REJECTED, None, f"no answer within {format_duration(timeout_s)} "
                               "(registry.approval.on_timeout: reject)", responded_at, True)
    by = (responded_by or {}).get("id") or None
    status = APPROVED if chosen[0] == APPROVE else REJECTED
    return ApprovalOutcome(status, by, reason, responded_at)


def with_history(tags: dict[str, str], history: str | None) -> dict[str, str]:
    """``tags`` plus :data:`TAG_HISTORY`: the version's ``history`` with one more line when
    ``tags`` record a decision (``pending`` is no decision: the history stays as it was).

    A line reads ``<at> <status> by <by> in <dag_run> try <try>: <reason>``; past
    :data:`HISTORY_MAX_CHARS` the oldest lines are dropped.
    """
    if tags.get(TAG_STATUS) not in DECISIONS:
        return dict(tags)
    line = (f"{tags.get(TAG_AT, '?')} {tags[TAG_STATUS]} by {tags.get(TAG_BY, 'none')} in "
            f"{tags.get(TAG_DAG_RUN, '?')} try {tags.get(TAG_TRY, '?')}: "
            f"{tags.get(TAG_REASON, 'none')}").replace("\n", " ")
    lines = [*(history or "").splitlines(), line]
    while len(lines) > 1 and len("\n".join(lines)) > HISTORY_MAX_CHARS:
        lines.pop(0)
    return {**tags, TAG_HISTORY: "\n".join(lines)[-HISTORY_MAX_CHARS:]}


def upstream_states(task: Any, context: Any) -> dict[str, str]:
    """``{task_id: state}`` in this DAG run of every task upstream of ``task``, read from Airflow
    through the Task SDK when asked (``"none"``: no state); ``{}`` for a task outside a DAG."""
    upstream = task.get_flat_relative_ids(upstream=True) if getattr(task, "has_dag", lambda: False)() else set()
    if not upstream:
        return {}
    ti = context["ti"]
    found = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id]) or {}
    states = found.get(ti.run_id) or {}
    return {task_id: str(getattr(states.get(task_id), "value", states.get(task_id)) or "none")
            for task_id in upstream}


def upstream_refusal(upstream_states: dict[str, str], dag_run: str) -> str | None:
    """Why ``champion`` must not move in this DAG run: an upstream task, validate_checkpoint
    among them, that is not in state success (a person marked it failed meanwhile); or None."""
    not_passed = {task: state for task, state in sorted(upstream_states.items()) if state != "success"}
    if not_passed:
        listed = ", ".join(f"{task} is {state}" for task, state in not_passed.items())
        return (f"{listed} in this DAG run ({dag_run}): champion moves only to a version whose "
                f"upstream tasks, validate_checkpoint among them, succeeded in this run")
    return None


def promotion_refusal(*, version: str, upstream_states: dict[str, str], tags: dict[str, str],
                      dag_run: str, try_number: int) -> str | None:
    """Why ``champion`` must not move to ``version`` now, or None (docs/registry.md, "The
    champion invariant").

    Args:
        upstream_states: task id -> state in this DAG run of every task upstream of the
            approval (``validate_checkpoint`` among them); ``"none"`` for no state.
        tags: the version's tags as they are now.
        dag_run: ``"<dag_id>/<run_id>"`` of this DAG run; ``try_number`` the approval's try.
    """
    refusal = upstream_refusal(upstream_states, dag_run)
    if refusal:
        return refusal
    asked = (tags.get(TAG_STATUS), tags.get(TAG_DAG_RUN), tags.get(TAG_TRY))
    if asked != (PENDING, dag_run, str(try_number)):
        return (f"v{version}'s approval tags say status {asked[0]} asked by {asked[1]} try "
                f"{asked[2]}, not pending for {dag_run} try {try_number}: the answer is not for "
                f"this request")
    return None


def _value(value: Any) -> str:
    return "—" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def request_body(*, gate: dict[str, Any], thresholds: dict[str, Any], model_card: str,
                 links: dict[str, str], timeout_s: int, on_timeout: str) -> str:
    """The Markdown a person reads before answering.

    Args:
        gate: the ``register_model`` XCom's ``gate`` (``trainforge.gate.GateDecision``).
        thresholds: spec field -> value of the absolute thresholds and the gate rule.
        model_card: the version's description (trainforge.model_card.model_card).
        links: title -> URL (MLflow run, model version, Airflow DAG run); empty ones left out.
    """
    version, champion = gate.get("candidate_version"), gate.get("champion_version")
    improvement = gate.get("improvement")
    lines = [
        f"The eval gate passed v{version}: {gate.get('reason')}.",
        "",
        f"Approve to move `champion` to v{version}; reject to keep "
        + (f"v{champion}" if champion else "no champion") + ".",
        f"Without an answer within {format_duration(timeout_s)} the request "
        + ("is rejected." if on_timeout == "reject" else "fails the task; champion stays."),
        "",
        "| | version | " + str(gate.get("metric")) + " |",
        "|---|---|---|",
        f"| candidate | v{version} | {_value(gate.get('candidate_value'))} |",
        f"| champion | {'v' + str(champion) if champion else '—'} | "
        f"{_value(gate.get('champion_value'))} |",
        "",
        f"Compared on the same validation split (method `{gate.get('method')}`); relative "
        f"improvement {'—' if improvement is None else f'{improvement:+.2%}'}.",
        "",
        "**Thresholds**",
        "",
        *[f"- `{key}`: {_value(value)}" for key, value in thresholds.items()],
        "",
        "**Links**",
        "",
        *[f"- [{title}]({url})" for title, url in links.items() if url],
        "",
        "**Model card**",
        "",
        *[("> " + line) if line else ">" for line in model_card.splitlines()],
    ]
    return "\n".join(lines)
