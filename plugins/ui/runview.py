"""The run view's answer: one DAG run of a trainforge pipeline.

From Airflow: the run, every try of every task (restarts on the timeline, links to the task
logs) and the tasks' results (XCom: the validated checkpoint, the registered version, the
gate's decision and the aliases set). From MLflow: the loss and learning-rate curves, the
run's tags (failed tries, validation, gate), the validation report (every checkpoint judged,
with the quarantine reasons) and the ledger's figures. MLflow calls share one deadline; when
MLflow does not answer, the Airflow half is still there and ``unavailable`` says so.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

from sqlalchemy.orm import Session

from trainforge.plugins.ui import metadata
from trainforge.plugins.ui.ledger import figures
from trainforge.plugins.ui.mlflow_reader import MlflowReader, MlflowUnavailable
from trainforge.plugins.ui.pool import POOL, bounded
from trainforge.plugins.ui.training import TAG_DAG_ID, TAG_RUN_ID, progress

CURVES = ("train_loss", "learning_rate")
REPORT_ARTIFACT = "validation/report.json"  # trainforge.tasks.validate_checkpoint
TAG_FAILED_TRY = "trainforge.failed_try."


class RunNotFound(LookupError):
    """No such DAG run."""


def _quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


def _mlflow_part(reader: MlflowReader, dag_id: str, run_id: str, deadline: float
                 ) -> tuple[dict[str, Any] | None, dict[str, Any], list[str]]:
    """The MLflow run, its curves and validation report, and what did not answer in time."""
    runs = reader.search_runs(f"tags.`{TAG_DAG_ID}` = '{_quoted(dag_id)}' and "
                              f"tags.`{TAG_RUN_ID}` = '{_quoted(run_id)}'", max_runs=10)
    parents = [r for r in runs if "mlflow.parentRunId" not in r["tags"]] or runs
    if not parents:
        return None, {}, []
    run = parents[0]
    rid = run["info"]["run_id"]
    calls = {POOL.submit(reader.metric_history, rid, key): key for key in CURVES}
    calls[POOL.submit(reader.artifact_json, rid, REPORT_ARTIFACT)] = "report"
    out: dict[str, Any] = {}
    late = []
    for future, name in bounded(calls, max(0.1, deadline - time.monotonic())):
        try:
            out[name] = future.result(timeout=0)
        except (MlflowUnavailable, TimeoutError) as err:
            late.append(f"{name}: {err or 'no answer in time'}")
    return run, out, late


def _checkpoints(report: dict[str, Any] | None, validated: dict[str, Any]) -> list[dict]:
    """Every checkpoint the validator judged (its report), with why any was quarantined; the
    validated one alone (XCom) when the report cannot be read."""
    if report:
        reasons = {q["checkpoint"]: q for q in report.get("quarantined") or []}
        rows = []
        for c in report.get("candidates") or []:
            moved = reasons.get(c["checkpoint"])
            rows.append({"checkpoint": c["checkpoint"], "step": c.get("step"), "ok": c.get("ok"),
                         "val_loss": c.get("val_loss"), "failed": c.get("failed") or [],
                         "chosen": c["checkpoint"] == report.get("checkpoint"),
                         "quarantined_to": moved["moved_to"] if moved else None,
                         "quarantine_reasons": moved.get("reasons", []) if moved else []})
        return rows
    if validated.get("checkpoint"):
        return [{"checkpoint": validated["checkpoint"], "step": validated.get("step"), "ok": True,
                 "val_loss": (validated.get("metrics") or {}).get("val_loss"), "failed": [],
                 "chosen": True, "quarantined_to": None, "quarantine_reasons": [],
                 "quarantined_elsewhere": validated.get("quarantined") or []}]
    return []


def run_view(session: Session, dag_id: str, run_id: str, reader: MlflowReader | None,
             timeout_s: float = 8.0) -> dict[str, Any]:
    """The run view's JSON (module doc). Raises RunNotFound."""
    run = metadata.dag_run(session, dag_id, run_id)
    if run is None:
        raise RunNotFound(f"no run {run_id!r} of DAG {dag_id!r}")
    tries = metadata.task_tries(session, dag_id, run_id)
    results = metadata.return_values(session, dag_id, run_id)
    for t in tries:
        t["log_url"] = (f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}/tasks/"
                        f"{quote(t['task_id'], safe='')}?try_number={t['try_number']}")
    registered = results.get("register_model") or {}
    validated = results.get("validate_checkpoint") or {}
    unavailable: list[dict[str, str]] = []
    ml_run, extra = None, {}
    if reader is None:
        unavailable.append({"source": "mlflow", "error": "no MLflow tracking URI configured "
                                                          "(MLFLOW_TRACKING_URI)"})
    else:
        deadline = time.monotonic() + timeout_s
        try:
            ml_run, extra, late = POOL.submit(_mlflow_part, reader, dag_id, run_id, deadline
                                              ).result(timeout=timeout_s)
            unavailable += [{"source": "mlflow", "error": e} for e in late]
        except (MlflowUnavailable, TimeoutError) as err:
            unavailable.append({"source": "mlflow", "error": str(err) or "no answer in time"})
    tags = ml_run["tags"] if ml_run else {}
    training = next((t for t in reversed(tries) if metadata.is_train_task(t["task_id"])), None)
    gate = registered.get("gate") or _gate_from_tags(tags)
    version = registered.get("version") or tags.get("trainforge.model_version")
    model = registered.get("name") or tags.get("trainforge.registered_model")
    return {
        "run": run,
        "tasks": tries,
        "training": bool(training and training["current"]
                         and training["state"] in metadata.LIVE_TASK_STATES),
        "progress": progress(ml_run, extra.get("train_loss")) if ml_run else None,
        "curves": {key: extra.get(key) or [] for key in CURVES},
        "disruptions": _disruptions(tries, tags),
        "checkpoints": _checkpoints(extra.get("report"), validated),
        "validation": {"checkpoint": validated.get("checkpoint"),
                       "metrics": validated.get("metrics") or {},
                       "policy": validated.get("policy")},
        "figures": figures(ml_run["metrics"], tags) if ml_run else None,
        "gate": gate,
        "model": {"name": model, "version": str(version) if version else None,
                  "aliases": registered.get("aliases") or [],
                  "url": reader.version_url(model, str(version))
                  if reader and model and version else None},
        "mlflow": {"run_id": ml_run["info"]["run_id"], "status": ml_run["info"].get("status"),
                   "url": reader.run_url(ml_run["info"]["experiment_id"],
                                         ml_run["info"]["run_id"])} if ml_run and reader else None,
        "partial": bool(unavailable),
        "unavailable": unavailable,
    }


def _gate_from_tags(tags: dict[str, str]) -> dict[str, Any] | None:
    prefix = "trainforge.gate."
    gate = {k[len(prefix):]: (None if v == "none" else v) for k, v in tags.items()
            if k.startswith(prefix)}
    return gate or None


def _disruptions(tries: list[dict[str, Any]], tags: dict[str, str]) -> list[dict[str, Any]]:
    """Tries that did not succeed (restarts by Airflow), with the reason the train task
    recorded (``trainforge.failed_try.<task>.<try>``), and torchrun's world-size changes."""
    out = []
    for t in tries:
        if t["state"] in ("failed", "up_for_retry", "upstream_failed", "removed") or (
                not t["current"] and t["state"] != "success"):
            reason = tags.get(f"{TAG_FAILED_TRY}{t['task_id']}.{t['try_number']}")
            out.append({"kind": "task try", "task_id": t["task_id"],
                        "try_number": t["try_number"], "state": t["state"],
                        "at": t["end_date"] or t["start_date"], "reason": reason or ""})
    sizes = tags.get("trainforge.world_size_history")
    if sizes and sizes.count("world_size") > 1:  # torchrun restarted the group
        out.append({"kind": "world size", "task_id": None, "try_number": None, "state": None,
                    "at": None, "reason": f"world sizes over restarts: {sizes}"})
    return out
