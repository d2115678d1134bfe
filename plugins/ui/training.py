"""The Training page's answers: :func:`overview` (every trainforge pipeline the user may read,
its last runs, what trains now, its champion and the champion metric's trend) and
:func:`window_totals` (each pipeline's last 30 days), which the page fetches right after.

Airflow's metadata answers first (one session, a few queries, only the DAGs the user may
read); MLflow is then asked, in the UI's threads and under one deadline
(trainforge.plugins.ui.mlflow_cache: data per DAG kept a few seconds). The overview searches
only the runs since its shown runs started, beside the registry's two calls; the totals search
every run of the window. When MLflow does not answer the page still lists the pipelines and
runs, and ``unavailable`` says what is missing.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from sqlalchemy.orm import Session

from trainforge.ledger.attempts import AttemptRecordError, attempt_records
from trainforge.plugins.ui import metadata, mlflow_cache
from trainforge.plugins.ui.ledger import figures
from trainforge.plugins.ui.mlflow_cache import TAG_DAG_ID  # noqa: F401  (runview reads it here)
from trainforge.plugins.ui.mlflow_reader import MlflowReader, MlflowUnavailable

RUNS_PER_PIPELINE = 5
WINDOW_DAYS = 30
CLOCK_SLACK = dt.timedelta(minutes=10)  # an MLflow run's start (the worker's clock) vs Airflow's
CHAMPION_ALIAS = "champion"
TAG_RUN_ID = "trainforge.airflow_run_id"
TAG_MODEL = "trainforge.registered_model"


def progress(run: dict[str, Any], history: list[dict[str, Any]] | None = None
             ) -> dict[str, Any]:
    """Step, max steps, ETA (s), tokens/s and last loss of an MLflow run (``search_runs``
    form). The ETA is the remaining steps at the pace between the first and last logged points
    of ``history`` (``train_loss``), else at the pace of the newest attempt's ledger record
    (first step to last record, docs/contracts.md "Run ledger"): never from the run's start,
    which counts data preparation and the trainer's startup as training time."""
    metrics, steps = run["metrics"], run["metric_steps"]
    step = steps.get("train_loss")
    max_steps = _number(run["params"].get("optim.max_steps"))
    eta = None
    if step and max_steps and step < max_steps:
        pace = None
        if history and len(history) >= 2 and history[-1]["step"] > history[0]["step"]:
            first, last = history[0], history[-1]
            pace = (last["timestamp"] - first["timestamp"]) / 1000 / (last["step"] - first["step"])
        else:
            pace = _attempt_pace(run["tags"])
        eta = pace * (max_steps - step) if pace is not None else None
    return {"step": step, "max_steps": int(max_steps) if max_steps else None,
            "eta_s": eta, "tokens_per_s": metrics.get("tokens_per_s", metrics.get("tps")),
            "loss": metrics.get("train_loss"), "learning_rate": metrics.get("learning_rate")}


def _attempt_pace(tags: dict[str, str]) -> float | None:
    """Seconds per step of the newest attempt that has trained a step, from the run's ledger
    records (trainforge.ledger.attempts); None when there is none or a record is unreadable."""
    try:
        records = attempt_records(tags)
    except AttemptRecordError:
        return None
    for record in reversed(records):
        try:
            first, last = float(record["first_step_at"]), float(record["recorded_at"])
            done = int(record["step"]) - int(record.get("resumed_step") or 0)
        except (TypeError, ValueError, KeyError):
            continue
        if done > 0 and last > first:
            return (last - first) / done
    return None


def _number(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _models(aliases: dict[str, dict[str, str]], versions: list[dict[str, Any]],
            names: set[str], reader: MlflowReader) -> dict[str, dict[str, Any]]:
    """For each registered model named: its champion version and the gate metric's trend over
    its versions, from the registry's aliases and versions (mlflow_cache.Registry)."""
    aliases = {name: found for name, found in aliases.items() if name in names}
    trends: dict[str, list[dict[str, Any]]] = {name: [] for name in aliases}
    for version in versions:
        if version.get("name") not in trends:
            continue
        tags = version["tags"]
        trends[version["name"]].append({
            "version": version["version"], "metric": tags.get("trainforge.gate.metric"),
            "value": _number(tags.get("trainforge.gate.candidate_value")),
            "decision": tags.get("trainforge.gate.decision"),
            "created": version.get("creation_timestamp")})
    out = {}
    for name, trend in trends.items():
        champion = None
        if CHAMPION_ALIAS in aliases[name]:
            version = aliases[name][CHAMPION_ALIAS]
            found = [t for t in trend if t["version"] == version]
            champion = {"model": name, "version": version,
                        "metric": found[0]["metric"] if found else None,
                        "value": found[0]["value"] if found else None,
                        "url": reader.version_url(name, version)}
        out[name] = {"model": name, "aliases": aliases[name], "champion": champion,
                     "trend": trend}
    return out


def _runs_since(reader: MlflowReader, dag_ids: list[str], since: dt.datetime, deadline: float,
                unavailable: list[dict[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The DAGs' MLflow runs started at ``since`` or later by (DAG id, Airflow run id), newest
    of each; a failure is appended to ``unavailable`` and leaves none."""
    try:
        by_dag = mlflow_cache.window_runs(reader, dag_ids, int(since.timestamp() * 1000),
                                          deadline)
    except (MlflowUnavailable, TimeoutError) as err:
        unavailable.append({"source": "mlflow", "error": str(err) or "no answer in time"})
        by_dag = {}
    mlflow_runs: dict[tuple[str, str], dict[str, Any]] = {}
    for dag_id, found in by_dag.items():
        for run in found:
            mlflow_runs.setdefault((dag_id, run["tags"].get(TAG_RUN_ID)), run)
    return mlflow_runs


def _mlflow(reader: MlflowReader, dag_ids: list[str], since: dt.datetime, timeout_s: float
            ) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, dict[str, Any]],
                       list[dict[str, str]]]:
    """The readable DAGs' MLflow runs since ``since`` by (DAG id, Airflow run id), newest of
    each, their registered models by DAG id, and what did not answer. The registry's calls
    start first and run beside the runs' search (mlflow_cache); both share one deadline."""
    deadline = time.monotonic() + timeout_s
    unavailable: list[dict[str, str]] = []
    registry = mlflow_cache.Registry(reader)
    mlflow_runs = _runs_since(reader, dag_ids, since, deadline, unavailable)
    names = {}
    for (dag_id, _), run in mlflow_runs.items():
        if run["tags"].get(TAG_MODEL):
            names.setdefault(dag_id, run["tags"][TAG_MODEL])
    models: dict[str, dict[str, Any]] = {}
    try:
        aliases, versions = registry.result(deadline)
    except (MlflowUnavailable, TimeoutError) as err:
        if names:
            unavailable.append({"source": "mlflow", "error": "model registry: "
                                                              f"{err or 'no answer in time'}"})
    else:
        by_name = _models(aliases, versions, set(names.values()), reader)
        models = {dag_id: by_name[name] for dag_id, name in names.items() if name in by_name}
    return mlflow_runs, models, unavailable


def _shown_since(runs: dict[str, list[dict[str, Any]]], window_start: dt.datetime,
                 now: dt.datetime) -> dt.datetime:
    """When the earliest started run shown began (less CLOCK_SLACK), not before the window:
    the MLflow runs of the shown runs all started then or later."""
    started = [_utc(dt.datetime.fromisoformat(r["start_date"])) for found in runs.values()
               for r in found if r.get("start_date")]
    return max(window_start, min(started, default=now) - CLOCK_SLACK)


def _utc(moment: dt.datetime) -> dt.datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.timezone.utc)


def overview(session: Session, readable: set[str] | None, reader: MlflowReader | None,
             timeout_s: float = 8.0) -> dict[str, Any]:
    """The Training page's first JSON (module doc), without the window's totals
    (:func:`window_totals`). Only the DAGs of ``readable`` (None: all) are read and answered,
    on every call: the MLflow cache holds data per DAG, never an answer."""
    now = dt.datetime.now(dt.timezone.utc)
    since = now - dt.timedelta(days=WINDOW_DAYS)
    dag_ids = metadata.pipeline_ids(session, readable)
    info = metadata.pipelines(session, dag_ids)
    runs = metadata.recent_runs(session, dag_ids, RUNS_PER_PIPELINE)
    counts = metadata.run_counts(session, dag_ids, since)
    live = {(t["dag_id"], t["run_id"]) for t in metadata.live_train_tasks(session, dag_ids)}
    unavailable: list[dict[str, str]] = []
    mlflow_runs: dict[tuple[str, str], dict[str, Any]] = {}
    models: dict[str, dict[str, Any]] = {}
    if reader is None:
        unavailable.append({"source": "mlflow", "error": "no MLflow tracking URI configured "
                                                          "(MLFLOW_TRACKING_URI)"})
    elif dag_ids:
        mlflow_runs, models, unavailable = _mlflow(reader, dag_ids,
                                                   _shown_since(runs, since, now), timeout_s)
    pipelines = []
    for dag_id in dag_ids:
        shown = []
        for run in runs[dag_id]:
            ml = mlflow_runs.get((dag_id, run["run_id"]))
            shown.append({**run, "training": (dag_id, run["run_id"]) in live,
                          "progress": progress(ml) if ml else None,
                          "mlflow_url": reader.run_url(ml["info"]["experiment_id"],
                                                       ml["info"]["run_id"]) if ml else None})
        pipelines.append({**info[dag_id], "runs": shown, "runs_30d": counts.get(dag_id, {}),
                          **{k: models.get(dag_id, {}).get(k) for k in ("model", "champion",
                                                                        "trend")}})
    return {"generated_at": now.isoformat(), "window_days": WINDOW_DAYS,
            "pipelines": pipelines, "partial": bool(unavailable), "unavailable": unavailable}


def window_totals(session: Session, readable: set[str] | None, reader: MlflowReader | None,
                  timeout_s: float = 8.0) -> dict[str, Any]:
    """Each readable pipeline's last 30 days from its MLflow runs (``last_30d``: DAG id ->
    :func:`_totals`); like :func:`overview`, only the DAGs of ``readable`` (None: all), asked
    on every call, from the per-DAG cache."""
    now = dt.datetime.now(dt.timezone.utc)
    dag_ids = metadata.pipeline_ids(session, readable)
    unavailable: list[dict[str, str]] = []
    mlflow_runs: dict[tuple[str, str], dict[str, Any]] = {}
    if reader is None:
        unavailable.append({"source": "mlflow", "error": "no MLflow tracking URI configured "
                                                          "(MLFLOW_TRACKING_URI)"})
    elif dag_ids:
        mlflow_runs = _runs_since(reader, dag_ids, now - dt.timedelta(days=WINDOW_DAYS),
                                  time.monotonic() + timeout_s, unavailable)
    totals = {dag_id: _totals([figures(r["metrics"], r["tags"])
                               for (d, _), r in mlflow_runs.items() if d == dag_id])
              for dag_id in dag_ids} if not unavailable else {}
    return {"generated_at": now.isoformat(), "window_days": WINDOW_DAYS, "last_30d": totals,
            "partial": bool(unavailable), "unavailable": unavailable}


def _totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over a pipeline's runs of the window; goodput as the GPU-hour-weighted mean of the
    runs that have one."""
    def total(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return sum(values) if values else None

    weighted = [(r["goodput_percent"], r["gpu_hours"] or 0.0) for r in runs
                if r["goodput_percent"] is not None]
    weight = sum(w for _, w in weighted)
    goodput = (sum(g * w for g, w in weighted) / weight if weight
               else (sum(g for g, _ in weighted) / len(weighted) if weighted else None))
    return {"runs": len(runs), "gpu_hours": total("gpu_hours"), "cost": total("cost"),
            "energy_kwh": total("energy_kwh"), "goodput_percent": goodput}
