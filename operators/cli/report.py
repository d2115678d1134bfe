"""``trainforge report PIPELINE``: every run of one pipeline from the MLflow store, with its ledger.

:func:`collect_report` reads the DAG runs' MLflow runs (tag ``trainforge.dag_id``, not the
stages' child runs) from every experiment of the store: per run its status, goodput, GPU-hours,
cost, energy and disruptions (trainforge.ledger.read; a staged pipeline's stages summed), and
per registered model version its validation metrics. :func:`print_report` shows it as tables;
trainforge.cli.report_plot draws it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainforge.hooks.mlflow_runs import TAG_DAG_ID
from trainforge.ledger import names as n
from trainforge.ledger.read import energy_sources_line, ledger_figures, stage_names
from trainforge.paths import trainforge_home

VALIDATION_METRICS = ("val/val_loss", "val/val_perplexity", "val/val_bits_per_byte")
SUMMED = (n.WALL_S, n.PRODUCTIVE_S, n.GPU_HOURS_ALLOCATED, n.GPU_HOURS_PRODUCTIVE, n.ENERGY_KWH,
          n.COST_ALLOCATED, n.DISRUPTIONS)


class UnknownPipelineError(LookupError):
    """No run of the pipeline is in the store."""


class StoreError(RuntimeError):
    """The MLflow store cannot be read: no such store, a server that does not answer, or not a
    tracking URI at all."""


HEALTH_TIMEOUT_S = 5.0


def check_store(tracking_uri: str) -> None:
    """Refuse a store the report cannot read, before MLflow is asked (a report reads a store,
    never creates one, and never waits minutes on a server that is not there).

    Raises:
        StoreError: names the URI, what is wrong and what was expected.
    """
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    scheme = urlsplit(tracking_uri).scheme
    if scheme == "sqlite":
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        if not db.is_file():
            raise StoreError(f"tracking URI {tracking_uri}: no MLflow store at {db} (run a "
                             "pipeline first, or set TRAINFORGE_HOME or --tracking-uri to the store "
                             "it wrote)")
    elif scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/health",
                                        timeout=HEALTH_TIMEOUT_S):
                pass
        except (OSError, urllib.error.URLError) as err:
            raise StoreError(f"tracking URI {tracking_uri}: the MLflow server does not answer "
                             f"({getattr(err, 'reason', err)})") from None
    elif not scheme.startswith(("postgresql", "mysql", "mssql", "databricks")):
        raise StoreError(f"tracking URI {tracking_uri}: not an MLflow tracking URI (expected "
                         "sqlite:///PATH, http(s)://HOST:PORT or postgresql://...)")


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI``, else the demo's store: ``$TRAINFORGE_HOME/mlflow/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{trainforge_home() / 'mlflow' / 'mlflow.db'}"


def _combined(metrics: dict[str, float], tags: dict[str, str]) -> dict[str, Any] | None:
    """The run's ledger; a staged pipeline's stages summed (goodput: productive over wall)."""
    own = ledger_figures(metrics, tags)
    if own is not None:
        return own
    stages = [ledger_figures(metrics, tags, s) for s in stage_names(metrics)]
    stages = [s for s in stages if s]
    if not stages:
        return None
    figures = {k: sum(s["figures"].get(k, 0.0) for s in stages) for k in SUMMED
               if any(k in s["figures"] for s in stages)}
    if figures.get(n.WALL_S):
        figures[n.GOODPUT] = 100.0 * figures.get(n.PRODUCTIVE_S, 0.0) / figures[n.WALL_S]
    tags_all = {k: v for s in stages for k, v in s["tags"].items()}
    for status in (n.ENERGY_STATUS, n.COST_STATUS):  # partial when any stage's is
        if any(s["tags"].get(status) == "partial" for s in stages):
            tags_all[status] = "partial"
    return {"figures": figures, "badput": {}, "tags": tags_all}


def collect_report(pipeline: str, tracking_uri: str) -> dict[str, Any]:
    """The report of ``pipeline`` (its dag_id), oldest run first.

    Raises:
        UnknownPipelineError: the store holds no run of it (names the pipelines it holds).
        StoreError: the store cannot be read (:func:`check_store`, or MLflow refuses it).
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    check_store(tracking_uri)
    try:
        return _collect(MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri),
                        pipeline, tracking_uri)
    except MlflowException as err:
        raise StoreError(f"tracking URI {tracking_uri}: {err.message}") from None


def _collect(client: Any, pipeline: str, tracking_uri: str) -> dict[str, Any]:
    """:func:`collect_report` on an open client."""
    if not re.fullmatch(r"[\w.\-]+", pipeline):
        raise UnknownPipelineError(f"{pipeline!r} is not a pipeline name (a DAG id: letters, "
                                   "digits, '_', '.' and '-')")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.`{TAG_DAG_ID}` = '{pipeline}'",
                              max_results=5000, order_by=["attributes.start_time ASC"]) if experiments else []
    runs = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if not runs:
        known = sorted({r.data.tags[TAG_DAG_ID] for r in client.search_runs(
            experiments, f"tags.`{TAG_DAG_ID}` != ''", max_results=5000)}) if experiments else []
        raise UnknownPipelineError(
            f"no run of pipeline {pipeline!r} in the MLflow store {tracking_uri} (pipelines there: "
            f"{', '.join(known) or 'none'})")
    rows, versions = [], []
    for run in runs:
        metrics, tags = run.data.metrics, run.data.tags
        ledger = _combined(metrics, tags)
        rows.append({"mlflow_run_id": run.info.run_id,
                     "airflow_run_id": tags.get("trainforge.airflow_run_id"),
                     "status": run.info.status, "start_time_ms": run.info.start_time,
                     "figures": (ledger or {}).get("figures", {}),
                     "tags": (ledger or {}).get("tags", {}),
                     "validation": {k: metrics[k] for k in VALIDATION_METRICS if k in metrics}})
        if tags.get("trainforge.model_version"):
            versions.append({"model": tags.get("trainforge.registered_model"),
                             "version": tags["trainforge.model_version"],
                             "mlflow_run_id": run.info.run_id,
                             "validation": rows[-1]["validation"]})
    return {"pipeline": pipeline, "tracking_uri": tracking_uri, "runs": rows, "versions": versions}


def print_report(report: dict[str, Any], console: Console) -> None:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    table = Table(title=f"trainforge report: {report['pipeline']}")
    for column in ("run", "status", "goodput", "GPU-h alloc", "GPU-h productive", "cost",
                   "energy kWh", "energy source", "disruptions", "val loss"):
        table.add_column(column, overflow="fold")
    for row in report["runs"]:
        f, t = row["figures"], row["tags"]
        sources = energy_sources_line(t)
        partial = {k: " (partial)" if t.get(k) == "partial" else "" for k in (n.ENERGY_STATUS, n.COST_STATUS)}
        cost = (f"{fmt(f.get(n.COST_ALLOCATED), '.4f')} {t.get('cost/currency', '')}".strip()
                + partial[n.COST_STATUS])
        table.add_row(row["airflow_run_id"] or row["mlflow_run_id"], row["status"],
                      fmt(f.get(n.GOODPUT), ".1f") + ("%" if n.GOODPUT in f else ""),
                      fmt(f.get(n.GPU_HOURS_ALLOCATED), ".4f"),
                      fmt(f.get(n.GPU_HOURS_PRODUCTIVE), ".4f"), cost,
                      fmt(f.get(n.ENERGY_KWH), ".5f") + partial[n.ENERGY_STATUS], sources,
                      fmt(f.get(n.DISRUPTIONS), ".0f"),
                      fmt(row["validation"].get("val/val_loss"), ".4f"))
    console.print(table)
    if report["versions"]:
        versions = Table(title="registered versions")
        for column in ("model", "version", "val loss", "val perplexity", "bits per byte", "run"):
            versions.add_column(column, overflow="fold")
        for v in report["versions"]:
            val = v["validation"]
            versions.add_row(v["model"] or "-", v["version"], fmt(val.get("val/val_loss"), ".4f"),
                             fmt(val.get("val/val_perplexity"), ".2f"),
                             fmt(val.get("val/val_bits_per_byte"), ".3f"), v["mlflow_run_id"])
        console.print(versions)
