"""The ``train`` task's ledger: built after the job succeeds, logged where the run shows it.

Into the run the trainer logged into (a stage's child run, else the DAG run's run): the
metrics and tags of trainforge.ledger.names under their own names, and the artifact
``ledger.json``. A stage's ledger also goes on the DAG run's run, which side-by-side stages
share, under ``stage/<stage>/<name>`` (metrics and tags) and ``ledger/<stage>.json``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from trainforge.hooks.mlflow import MlflowHook
from trainforge.ledger import names as n
from trainforge.ledger.build import Ledger, build_ledger
from trainforge.ledger.catalog import Price
from trainforge.pipeline.model import PipelineSpec

log = logging.getLogger(__name__)


def stage_key(stage: str, name: str) -> str:
    """A stage's metric or tag on the DAG run's run: ``stage/<stage>/<name>``."""
    return f"stage/{stage}/{name}"


def record_ledger(hook: MlflowHook, spec: PipelineSpec, event: dict[str, Any], price: Price | str,
                  *, own_run: str, parent_run: str, stage: str | None,
                  task_started_s: float | None, try_number: int) -> Ledger:
    """Build the job's ledger (trainforge.ledger.build) and log it; returns it."""
    job = (event.get("handle") or {}).get("identity") or {}
    ledger = build_ledger(spec, event, hook.get_run(own_run).data.tags, price,
                          task_started_s=task_started_s, now_s=time.time(),
                          submitted_by_this_try=int(job.get("try_number") or 0) == try_number)
    hook.log_metrics(own_run, ledger.metrics)
    hook.set_tags(own_run, ledger.tags)
    hook.log_dict_artifact(own_run, ledger.to_json(), n.ARTIFACT)
    if stage is not None and own_run != parent_run:
        hook.log_metrics(parent_run, {stage_key(stage, k): v for k, v in ledger.metrics.items()})
        hook.set_tags(parent_run, {stage_key(stage, k): v for k, v in ledger.tags.items()})
        hook.log_dict_artifact(parent_run, ledger.to_json(), f"ledger/{stage}.json")
    b = ledger.books
    log.info("Ledger: goodput %.1f%% (%.1f s productive of %.1f s wall); badput %s; %d "
             "disruption(s)", b.goodput_pct, b.productive_s, b.wall_s,
             ", ".join(f"{k} {v:.1f} s" for k, v in b.buckets.items() if v),
             int(ledger.metrics[n.DISRUPTIONS]))
    if b.clock_skew_s > 0.01 * b.wall_s:
        log.warning("Ledger: the buckets exceed the wall time by %.1f s (clocks of rank 0's machine "
                    "and this one disagree?)", b.clock_skew_s)
    return ledger
