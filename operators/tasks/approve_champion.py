"""The ``approve_champion`` task: a person approves a gate pass before ``champion`` moves.

Present only with ``registry.approval`` (docs/registry.md, "Human approval"). It follows
``register_model``, whose gate then only records its decision:

1. the gate did not pass, or the version holds ``champion`` in the registry (a cleared approval
   after an Approve) → skipped: nothing to approve, the recorded decision stays;
2. the version must still exist (else the task fails); it is tagged
   ``trainforge.approval.status: pending`` and Airflow's human-in-the-loop request is written
   (the gate's report, ``Approve`` / ``Reject``, a ``reason``, the spec's approvers); the task
   waits in Airflow's ``awaiting_input`` state, holding no worker slot;
3. the answer (UI or REST) resumes it: **Approve** moves ``champion`` and emits the asset event
   of ``register_model``'s outlet, unless the alias moved since the gate compared, or (the
   champion invariant, read right before the move) an upstream task of this DAG run such as
   ``validate_checkpoint`` is not success or the version's tags are not pending for this DAG
   run and try: then nothing moves and the task fails. **Reject** tags the version rejected;
   champion stays. A timeout never promotes: ``on_timeout: reject`` rejects, ``on_timeout:
   fail`` closes the request and fails the task;
4. ``registry.approval.notify`` mails the posted request (trainforge.approval.notify).

Ended without an answer (the task, its DAG run or an upstream task marked), the request is
closed and the version tagged ``cancelled`` by the plugin's listener (trainforge.approval.close),
told by the XCom ``trainforge_approval_request``; a task resumed by such a closed request fails.
Decisions are kept, oldest first, in the version's ``trainforge.approval.history`` tag.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any
from urllib.parse import quote

from airflow.providers.standard.operators.hitl import HITLOperator
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import AirflowSkipException

from trainforge.approval import (
    APPROVE,
    CANCELLED,
    CLOSED_BY_ID,
    PENDING,
    REASON_PARAM,
    REJECT,
    TAG_AT,
    TAG_BY,
    TAG_DAG_RUN,
    TAG_HISTORY,
    TAG_REASON,
    TAG_STATUS,
    TAG_TRY,
    TIMED_OUT,
    ApprovalOutcome,
    outcome_of,
    promotion_refusal,
    request_body,
    upstream_states,
    with_history,
)
from trainforge.approval.close import REQUEST_XCOM_KEY
from trainforge.approval.notify import notifiers_for, remaining_timeout, request_html, run_notifiers
from trainforge.base import TrainforgeStageOperator, fail_permanently
from trainforge.gate import PASS
from trainforge.hooks.mlflow_registry import CHAMPION, ModelRegistry
from trainforge.pipeline.durations import format_duration
from trainforge.model_card import airflow_run_url
from trainforge.tasks.register_model import emit_champion_event


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class ApproveChampionOperator(TrainforgeStageOperator, HITLOperator):
    """Ask a person to approve the gate's pass; move ``champion`` on approval (module doc).

    Args:
        approvers: Airflow user ids that may answer; None: whoever the auth manager allows.
        timeout_s: how long the request waits (``registry.approval.timeout``).
        on_timeout: ``"reject"`` or ``"fail"`` (``registry.approval.on_timeout``).
        register_task_id: the task whose XCom holds the version and the gate decision.
        notify: ``registry.approval.notify`` as the spec's JSON dump; None: nobody is told.

    XCom: ``{"name", "version", "status", "by", "reason", "at", "timed_out", "promoted",
    "champion_after"}``.
    """

    ui_color = "#fbeed5"

    def __init__(self, *, approvers: list[str] | None, timeout_s: int, on_timeout: str,
                 register_task_id: str = "register_model",
                 notify: dict[str, Any] | None = None, **kwargs: Any):
        # Airflow hands the DAG's params in as `params`; the request's form keeps only the
        # task's own (HITLOperator filters by source), the reason.
        params = ParamsDict(kwargs.pop("params", None) or {})
        params[REASON_PARAM] = Param("", type="string", title="Reason", source="task",
                                     description="Why (kept on the model version).")
        super().__init__(
            subject="Promote a model version to champion?",
            options=[APPROVE, REJECT],
            defaults=[REJECT] if on_timeout == "reject" else None,
            params=params,
            assigned_users=[{"id": name, "name": name} for name in approvers or []] or None,
            response_timeout=dt.timedelta(seconds=timeout_s),
            **kwargs,
        )
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self.register_task_id = register_task_id
        self.notify = notify

    @property
    def _registry(self) -> ModelRegistry:
        return ModelRegistry(self.mlflow_hook)

    def _registered(self, context: Any) -> tuple[str, str, dict[str, Any]]:
        """(model name, version, gate decision) from ``register_model``'s XCom."""
        registered = context["ti"].xcom_pull(task_ids=self.register_task_id) or {}
        gate = registered.get("gate") or {}
        if not registered.get("name") or not registered.get("version"):
            fail_permanently(f"no registered version to approve ({self.register_task_id} XCom "
                             f"was {registered!r})")
        return registered["name"], str(registered["version"]), gate

    def _require_version(self, name: str, version: str) -> dict[str, Any]:
        found = self._registry.version(name, version)
        if found is None:
            fail_permanently(f"registered model {name} v{version} no longer exists (deleted "
                             f"since register_model registered it): nothing to approve, "
                             f"champion unchanged")
        return found

    def execute(self, context: Any) -> Any:
        spec = self.resolved_spec(context)
        self.link_mlflow_run(context, spec)
        name, version, gate = self._registered(context)
        if gate.get("decision") != PASS:
            raise AirflowSkipException(f"eval gate {gate.get('decision')} for {name} "
                                       f"v{version}: nothing to approve")
        now = self._registry.version_with_alias(name, CHAMPION)
        if str(gate.get("champion_after")) == version or (now and now["version"] == version):
            status = ((now or {}).get("tags") or {}).get(TAG_STATUS, "none")
            raise AirflowSkipException(f"{name} v{version} already holds {CHAMPION}: nothing to "
                                       f"approve (its approval status stays {status})")
        found = self._require_version(name, version)
        ti = context["ti"]
        # Asked (again): an earlier answer's or cancel's who and why no longer apply; the
        # decisions stay in the history tag.
        self._registry.set_version_tags(name, version, {
            TAG_STATUS: PENDING, TAG_BY: "none", TAG_REASON: "none", TAG_AT: _now(),
            TAG_DAG_RUN: f"{ti.dag_id}/{ti.run_id}", TAG_TRY: str(ti.try_number)})
        self.subject = f"Promote {name} v{version} to {CHAMPION}?"
        self.body = request_body(
            gate=gate, thresholds=_thresholds(spec), model_card=found.get("description") or "",
            links=self._links(name, version, found.get("run_id"), ti.dag_id, ti.run_id),
            timeout_s=self.timeout_s, on_timeout=self.on_timeout)
        ti.xcom_push(key=REQUEST_XCOM_KEY, value={
            "name": name, "version": version, "tracking_uri": self.mlflow_hook.tracking_uri,
            "upstream": sorted(self.get_flat_relative_ids(upstream=True))})
        self.log.info("Asking for approval of %s v%s (%s); waiting at most %ss", name, version,
                      gate.get("reason"), self.timeout_s)
        # HITLOperator.execute posts the request, calls its notifiers, then parks the task with
        # response_timeout: the notifiers shorten that wait by the time they took.
        self.response_timeout = dt.timedelta(seconds=self.timeout_s)
        self.notifiers = [self._notify_approvers] if self.notify else []
        self._posted = time.monotonic()
        return super().execute(context)

    def _notify_approvers(self, context: Any) -> None:
        """Send the posted request (registry.approval.notify); never raises (module doc, 4)."""
        try:
            try:
                url = self.generate_link_to_ui(task_instance=context["ti"])
            except Exception:  # noqa: BLE001 - no api.base_url: the mail goes without a link
                url = None
            results = run_notifiers(notifiers_for(
                self.notify, subject=self.subject, html=request_html(self.body or "", url)),
                context)
            self.log.info("Approval request sent: %s", results or "no notifiers")
        except Exception:  # noqa: BLE001 - building a notifier failed: logged, the gate waits
            self.log.exception("Sending the approval request failed; it waits all the same")
        self.response_timeout = remaining_timeout(self.timeout_s, self._posted)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        name, version, gate = self._registered(context)
        if "error" in event:  # no answer and no default (on_timeout: fail)
            reason = (f"timed out: no answer within {format_duration(self.timeout_s)} "
                      "(registry.approval.on_timeout: fail)")
            self._close_request(context, reason)
            self._record(name, version, {
                TAG_STATUS: TIMED_OUT, TAG_BY: "none", TAG_REASON: reason, TAG_AT: _now()})
            self.log.error("No answer for %s v%s within %ss (registry.approval.on_timeout: "
                           "fail): champion unchanged", name, version, self.timeout_s)
        answer = super().execute_complete(context, event)  # raises on the timeout error
        if (answer.get("responded_by_user") or {}).get("id") == CLOSED_BY_ID:
            reason = (answer.get("params_input") or {}).get(REASON_PARAM) or "closed"
            fail_permanently(f"the approval of {name} v{version} was closed without an answer "
                             f"({reason}); {CHAMPION} unchanged")
        responded_at = answer.get("responded_at")
        outcome = outcome_of(
            list(answer["chosen_options"]), dict(answer.get("params_input") or {}),
            answer.get("responded_by_user"),
            responded_at.isoformat() if hasattr(responded_at, "isoformat") else _now(),
            bool(event.get("timedout")), self.timeout_s)
        found = self._require_version(name, version)
        if outcome.promote:
            self._promote(context, name, version, gate, outcome, found["tags"])
        else:
            if CHAMPION in found["aliases"]:
                fail_permanently(
                    f"{name} v{version} became {CHAMPION} while this request waited: a Reject "
                    f"cannot take it back, so its recorded decision stays "
                    f"({found['tags'].get(TAG_STATUS)}); move the alias in MLflow if needed")
            self._record(name, version, outcome.tags(), found["tags"])
            self.log.warning("%s v%s rejected by %s: %s. champion unchanged.", name, version,
                             outcome.by or "the timeout", outcome.reason or "no reason given")
        after = self._registry.version_with_alias(name, CHAMPION)
        return {"name": name, "version": version, **outcome.as_xcom(),
                "champion_after": after["version"] if after else None}

    def _close_request(self, context: Any, reason: str) -> None:
        """Answer the timed-out request ``Reject`` (by nobody) so that a late answer gets 409."""
        from airflow.sdk.execution_time.hitl import update_hitl_detail_response

        try:
            update_hitl_detail_response(ti_id=context["ti"].id, chosen_options=[REJECT],
                                        params_input={REASON_PARAM: reason})
        except Exception:  # noqa: BLE001 - answered meanwhile, or no API: the task fails anyway
            self.log.warning("Could not close the timed-out request", exc_info=True)

    def _record(self, name: str, version: str, tags: dict[str, str],
                before: dict[str, str] | None = None) -> None:
        """Write a decision's tags on the version, the decision added to its history tag;
        ``before``: the version's tags as read (None: read them now)."""
        if before is None:
            before = (self._registry.version(name, version) or {}).get("tags") or {}
        asked = {key: before[key] for key in (TAG_DAG_RUN, TAG_TRY) if key in before}
        self._registry.set_version_tags(
            name, version, with_history({**asked, **tags}, before.get(TAG_HISTORY)))

    def _upstream_states(self, context: Any) -> dict[str, str]:
        return upstream_states(self, context)

    def _promote(self, context: Any, name: str, version: str, gate: dict[str, Any],
                 outcome: ApprovalOutcome, tags: dict[str, str]) -> None:
        """Move ``champion`` to the approved version, unless it moved since the gate compared
        or the champion invariant does not hold now (:func:`promotion_refusal`)."""
        ti = context["ti"]
        dag_run = f"{ti.dag_id}/{ti.run_id}"
        states = self._upstream_states(context)
        refusal = promotion_refusal(version=version, upstream_states=states, tags=tags,
                                    dag_run=dag_run, try_number=ti.try_number)
        if refusal is not None:
            if any(state != "success" for state in states.values()):
                self._record(name, version, {
                    TAG_STATUS: CANCELLED, TAG_BY: "unknown", TAG_AT: _now(),
                    TAG_REASON: f"cancelled: {refusal}; approved by {outcome.by}"}, tags)
            fail_permanently(f"not moving {CHAMPION} of {name} to v{version}: {refusal}")
        compared = gate.get("champion_version")
        now = self._registry.version_with_alias(name, CHAMPION)
        current = now["version"] if now else None
        if current != version and current != compared:
            self._registry.set_version_tags(name, version, {**outcome.tags(),
                                                            TAG_STATUS: PENDING})
            fail_permanently(
                f"{CHAMPION} of {name} moved from v{compared} to v{current} since the eval gate "
                f"compared v{version} with it: not moving it (clear register_model to compare "
                f"again)")
        self._registry.promote(name, version, compared, with_history(
            {TAG_DAG_RUN: dag_run, TAG_TRY: str(ti.try_number), **outcome.tags()},
            tags.get(TAG_HISTORY)))
        self.log.info("%s v%s approved by %s: %s is now v%s", name, version, outcome.by,
                      CHAMPION, version)
        emit_champion_event(self, context, name, version, compared)

    def _links(self, name: str, version: str, run_id: str | None, dag_id: str,
               dag_run_id: str) -> dict[str, str]:
        """Title -> URL of the version, its MLflow run and this DAG run (empty when unknown)."""
        base = self.mlflow_hook.tracking_uri.rstrip("/")
        links = {f"MLflow model version {name} v{version}":
                 f"{base}/#/models/{quote(name, safe='')}/versions/{version}"}
        if run_id:
            try:
                experiment = self.mlflow_hook.get_run(run_id).info.experiment_id
                links["MLflow run"] = f"{base}/#/experiments/{experiment}/runs/{run_id}"
            except Exception:  # noqa: BLE001 - a link is a convenience
                self.log.debug("no MLflow run link for run %s", run_id, exc_info=True)
        links["Airflow DAG run"] = airflow_run_url(dag_id, dag_run_id)
        return links


def _thresholds(spec) -> dict[str, Any]:
    """The spec's absolute thresholds and gate rule, as written (``None``: not set)."""
    v = spec.validation
    return {"validation.max_val_loss": v.max_val_loss,
            "validation.max_val_perplexity": v.max_val_perplexity,
            "validation.require_beats_unigram": v.require_beats_unigram,
            "validation.gate.metric": v.gate.metric,
            "validation.gate.min_improvement": v.gate.min_improvement}
