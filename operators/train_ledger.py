"""The ``train`` task's ledger: built at each outcome of a try, logged where the run shows it.

Into the run the trainer logged into (a stage's child run, else the DAG run's run): the
metrics and tags of trainforge.ledger.names under their own names, and the artifact
``ledger.json``. A stage's ledger also goes on the DAG run's run, which side-by-side stages
share, under ``stage/<stage>/<name>`` (metrics and tags) and ``ledger/<stage>.json``.

Every outcome (a failed try, the try that succeeds) logs the ledger over every try so far, at
step ``<try number>`` with the tag ``ledger/try``: two outcomes never put two values at one
step, and a metric's latest value is the latest outcome's. The ledger's own tags (``ledger/*``,
``energy/*``, ``cost/*``) that the new ledger does not set are deleted, so no earlier try's tag
contradicts it. The try's record (trainforge.ledger.tries) is written beside the attempt records.

The attempt records are read from the run's tags and from the task's ledger folder
(:func:`ledger_dir`, beside the checkpoints every try shares), where the trainer writes them
too: a trainer without MLflow, on any engine, is still on the bill of every later try.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from trainforge.contract import LEDGER_DIR, LEDGER_DIR_ENV
from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.mlflow_calls import mlflow_errors
from trainforge.ledger import names as n
from trainforge.ledger.attempts import folder_records, merge_records
from trainforge.ledger.build import Ledger, build_ledger
from trainforge.ledger.catalog import Price
from trainforge.ledger.tries import (earlier_tries, encode, oom_figures, try_ended, try_records, try_started,
                                     try_tag)
from trainforge.pipeline.spec import PipelineSpec
from trainforge.storage import StorageError, storage_for

log = logging.getLogger(__name__)
OWN_TAG_ROOTS = ("ledger", "energy", "cost")
"""The first part of every tag the ledger sets (trainforge.ledger.names)."""


def stage_key(stage: str, name: str) -> str:
    """A stage's metric or tag on the DAG run's run: ``stage/<stage>/<name>``."""
    return f"stage/{stage}/{name}"


def ledger_dir(checkpoint_dir: str) -> str:
    """The task's ledger folder: ``<checkpoint folder>/ledger``, keyed like the checkpoints by
    DAG, run and stage, so shared by every try of the task on every engine (a path or an
    ``s3://`` prefix); the ranks get it as ``$TRAINFORGE_LEDGER_DIR``."""
    return str(storage_for(checkpoint_dir).join(checkpoint_dir, LEDGER_DIR))


def ledger_env(checkpoint_dir: str) -> dict[str, str]:
    """The ranks' environment naming the task's ledger folder (trainforge.trainer.goodput)."""
    return {LEDGER_DIR_ENV: ledger_dir(checkpoint_dir)}


def task_records(folder: str | None, s3_client: Any = None) -> dict[str, str]:
    """Every try's attempt records in the task's ledger folder, keyed as their MLflow tags; empty
    (with a warning naming the folder) when it cannot be read."""
    if not folder:
        return {}
    try:
        return folder_records(folder, storage_for(folder, s3_client))
    except (StorageError, UnicodeDecodeError) as err:
        log.warning("could not read the attempt records in %s (%s): the ledger counts those "
                    "in MLflow only", folder, err)
        return {}


def record_try_started(hook: MlflowHook, run_id: str, try_number: int,
                       task_started_s: float | None, handle: dict[str, Any]) -> None:
    """This try's record once it has its job: when it started and submitted."""
    hook.set_tags(run_id, {try_tag(try_number): encode(try_started(try_number, task_started_s, handle))})


def stale_tags(tags: dict[str, str], kept: dict[str, str], prefix: str = "") -> list[str]:
    """The ledger's tags in ``tags`` (under ``prefix``) that the new ledger's ``kept`` does not set."""
    return sorted(k for k in tags if k.startswith(prefix) and k[len(prefix):] not in kept
                  and k[len(prefix):].split("/")[0] in OWN_TAG_ROOTS)


def _replace_tags(hook: MlflowHook, run_id: str, tags: dict[str, str], old: dict[str, str],
                  prefix: str = "") -> None:
    hook.set_tags(run_id, {prefix + k: v for k, v in tags.items()})
    for key in stale_tags(old, tags, prefix):
        with mlflow_errors("delete_tag", f"run {run_id}"):
            hook.client.delete_tag(run_id, key)


def record_ledger(hook: MlflowHook, spec: PipelineSpec, event: dict[str, Any], price: Price | str,
                  *, own_run: str, parent_run: str, stage: str | None,
                  task_started_s: float | None, try_number: int,
                  records: dict[str, str] | None = None) -> Ledger:
    """Build the job's ledger over every try so far (trainforge.ledger.build) and log it at step
    ``try_number``; returns it. ``records``: attempt records found outside MLflow
    (:func:`task_records`), merged with the run's."""
    job = (event.get("handle") or {}).get("identity") or {}
    tags = hook.get_run(own_run).data.tags
    now = time.time()
    earlier = earlier_tries(tags, try_number)
    ledger = build_ledger(spec, event, merge_records(tags, records or {}), price,
                          task_started_s=task_started_s, now_s=now,
                          submitted_by_this_try=int(job.get("try_number") or 0) == try_number,
                          earlier_tries=earlier, try_number=try_number)
    ledger.tags[n.TRY] = str(try_number)
    this_try = try_ended(try_records(tags).get(try_number), try_number, task_started_s, event, now)
    hook.set_tags(own_run, {try_tag(try_number): encode(this_try)})
    oom_metrics, oom_tags = oom_figures([*earlier, this_try])  # each out of memory and the micro-batch after it
    ledger.metrics.update(oom_metrics)
    ledger.tags.update(oom_tags)
    hook.log_metrics(own_run, ledger.metrics, step=try_number)
    _replace_tags(hook, own_run, ledger.tags, tags)
    hook.log_dict_artifact(own_run, ledger.to_json(), n.ARTIFACT)
    if stage is not None and own_run != parent_run:
        hook.log_metrics(parent_run, {stage_key(stage, k): v for k, v in ledger.metrics.items()},
                         step=try_number)
        _replace_tags(hook, parent_run, ledger.tags, hook.get_run(parent_run).data.tags,
                      stage_key(stage, ""))
        hook.log_dict_artifact(parent_run, ledger.to_json(), f"ledger/{stage}.json")
    b = ledger.books
    log.info("Ledger (try %d, over %d try(s) and %d attempt(s)): goodput %.1f%% (%.1f s "
             "productive of %.1f s wall); badput %s; %d disruption(s)", try_number,
             ledger.window["tries"], ledger.window["attempts"], b.goodput_pct, b.productive_s,
             b.wall_s, ", ".join(f"{k} {v:.1f} s" for k, v in b.buckets.items() if v),
             int(ledger.metrics[n.DISRUPTIONS]))
    if b.clock_skew_s > 0.01 * b.wall_s:
        log.warning("Ledger: the buckets exceed the wall time by %.1f s (clocks of rank 0's machine "
                    "and this one disagree?)", b.clock_skew_s)
    return ledger
