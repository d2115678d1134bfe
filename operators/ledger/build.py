"""One training job's ledger from the trainer's attempt records, the engine's event and the task.

    wall      task start (or the first attempt's start, if earlier) -> the task's end
    buckets   trainer: program_startup, checkpoint_restore, data_loading, checkpoint_save,
                       evaluation, wasted_progress, recovery     (trainforge.ledger.attempts)
              engine:  queue_wait, image_pull                      (JobStatus.phases)
              task:    orchestration = task start -> job submission (when this try submitted)
                                       + job end -> task end
              other:   the remainder                               (trainforge.ledger.books)

Figures: goodput = productive / wall; the seconds checkpoints were written in the background
(beside the steps, so in no bucket); tokens/s per device (torchtitan's ``tps``) over the
productive step time; TFLOP/s per device and MFU (trainforge.ledger.devices); GPU-hours
allocated (the engine's wall time x GPUs) and productive; energy (trainforge.ledger.energy); the
allocated cost (trainforge.ledger.catalog).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from trainforge.ledger import names as n
from trainforge.ledger.attempts import attempt_records, sum_attempts
from trainforge.ledger.books import Books, close_books
from trainforge.ledger.catalog import Price
from trainforge.ledger.devices import mfu_pct
from trainforge.ledger.energy import job_energy
from trainforge.pipeline.model import PipelineSpec


@dataclass
class Ledger:
    """What is logged: metrics (numbers), tags (sources, and why a figure is missing)."""

    books: Books
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``ledger.json`` artifact (docs/contracts.md, "Run ledger")."""
        return {"schema": n.SCHEMA, "metrics": self.metrics, "tags": self.tags,
                "buckets_s": self.books.buckets, "unknown": self.books.unknown,
                "wall_s": self.books.wall_s, "productive_s": self.books.productive_s}


def build_ledger(spec: PipelineSpec, event: dict[str, Any], run_tags: dict[str, str],
                 price: Price | str, *, task_started_s: float | None, now_s: float,
                 submitted_by_this_try: bool) -> Ledger:
    """The ledger of the job that ``event`` (a ``success`` trigger event) reports.

    Args:
        run_tags: the tags of the MLflow run the trainer logged into (its attempt records).
        price: `trainforge.ledger.catalog.choose_price`'s answer.
        task_started_s: when this try of the task first started (epoch s), if known.
        submitted_by_this_try: this try launched the job (else it adopted an earlier try's).
    """
    records = attempt_records(run_tags)
    trainer = sum_attempts(records)
    handle = event.get("handle") or {}
    submitted = handle.get("submitted_at_epoch_s")
    start = min(x for x in (task_started_s, trainer.first_start, submitted, now_s) if x is not None)
    job_end = event.get("ended_at_epoch_s") or trainer.last_record or now_s
    before = (submitted - task_started_s) if submitted_by_this_try and submitted and task_started_s else 0.0
    buckets: dict[str, float | str] = dict(trainer.buckets)
    buckets["orchestration"] = max(0.0, before) + max(0.0, now_s - job_end)
    phases = event.get("phases") or {}
    for name in ("queue_wait", "image_pull"):
        buckets[name] = phases.get(name, f"unknown: the {spec.training.engine} engine did not say")
    if task_started_s is not None and trainer.first_start is not None \
            and trainer.first_start < task_started_s:
        # An earlier try's attempt failed: this try's start, submission, queue and image pull
        # lie in the gap after it, which is recovery; each is counted once, under its own name.
        overlap = sum(v for k, v in buckets.items() if k in ("queue_wait", "image_pull")
                      and not isinstance(v, str)) + max(0.0, before)
        buckets["recovery"] = max(0.0, float(buckets["recovery"]) - overlap)
    if not records:
        for name in trainer.buckets:
            buckets[name] = "unknown: the trainer left no attempt record (no MLflow tracking)"
    books = close_books(now_s - start, trainer.productive_s, buckets)
    ledger = Ledger(books)
    m, t = ledger.metrics, ledger.tags
    m[n.WALL_S], m[n.PRODUCTIVE_S], m[n.GOODPUT] = books.wall_s, books.productive_s, books.goodput_pct
    m.update({n.badput(k): v for k, v in books.buckets.items()})
    t.update({n.unknown_tag(k): why for k, why in books.unknown.items()})
    m[n.DISRUPTIONS] = float(max(0, len(records) - 1))
    if trainer.background_save_s is not None:  # a trainer from before background writes records none
        m[n.CHECKPOINT_BACKGROUND_S] = trainer.background_save_s
    if trainer.recoveries_s:
        m[n.RECOVERY_MEAN_S] = statistics.mean(trainer.recoveries_s)
        m[n.RECOVERY_MAX_S] = max(trainer.recoveries_s)
    _throughput(ledger, trainer.productive_tokens, trainer.productive_s, trainer.world_size,
                trainer.flops_per_token, trainer.device)
    _usage(ledger, spec, records, event.get("wall_s") or books.wall_s, price)
    return ledger


def _throughput(ledger: Ledger, tokens: int, productive_s: float, world: int | None,
                fpt: float | None, device: str | None) -> None:
    m, t = ledger.metrics, ledger.tags
    if not tokens or productive_s <= 0 or not world:
        for name in (n.TPS, n.TFLOPS, n.MFU_PCT):
            t[n.unknown_tag(name)] = "unknown: no productive step was recorded"
        return
    m[n.TPS] = tokens / productive_s / world
    if fpt:
        m[n.TFLOPS] = fpt * m[n.TPS] / 1e12
        mfu = mfu_pct(fpt, m[n.TPS], device or "")
        if mfu is not None:
            m[n.MFU_PCT] = mfu
        else:
            t[n.unknown_tag(n.MFU_PCT)] = f"unknown: no peak FLOP/s known for device {device!r}"


def _usage(ledger: Ledger, spec: PipelineSpec, records: list[dict[str, Any]], allocated_s: float,
           price: Price | str) -> None:
    """GPU-hours, energy and cost; allocated time is the engine's wall time of the job."""
    res = spec.training.resources
    m, t = ledger.metrics, ledger.tags
    hours = max(0.0, allocated_s) / 3600.0
    gpu_hours = hours * res.nodes * res.gpus_per_node
    cpu_core_hours = hours * res.nodes * res.processes_per_node * res.cpus_per_process
    m[n.GPU_HOURS_ALLOCATED] = gpu_hours
    m[n.GPU_HOURS_PRODUCTIVE] = ledger.books.productive_s / 3600.0 * res.nodes * res.gpus_per_node
    energy = job_energy(spec, records, gpu_hours, cpu_core_hours)
    if energy.kwh:  # what was read or estimated; energy/status says whether that is all of it
        m[n.ENERGY_KWH] = sum(energy.kwh.values())
    else:
        t[n.unknown_tag("energy_kwh")] = "unknown: no device's energy was read or estimated"
    t.update({n.energy_source_tag(key): source for key, source in energy.sources.items()})
    t.update({n.energy_reason_tag(key): why for key, why in energy.reasons.items()})
    t[n.ENERGY_STATUS] = energy.status
    if isinstance(price, str):
        t[n.unknown_tag("cost_allocated")] = price
        return
    t[n.COST_STATUS] = energy.status
    m[n.COST_ALLOCATED] = price.cost(hours * res.nodes, gpu_hours, cpu_core_hours)
    t.update({"cost/currency": price.currency, "cost/price_source": price.source,
              "cost/price_date": price.date})
