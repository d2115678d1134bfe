"""One training job's ledger from the trainer's attempt records, the engine's event and the task.

    wall      the first try's start (or the first attempt's, if earlier) -> this try's end: one
              window over every try and attempt (trainforge.ledger.tries)
    buckets   trainer: program_startup, checkpoint_restore, data_loading, checkpoint_save,
                       evaluation, compile, wasted_progress, recovery (trainforge.ledger.attempts)
              engine:  queue_wait, image_pull                      (JobStatus.phases)
              task:    orchestration = each try's start -> its job submission (when it
                                       submitted) + its job's end -> its end
              other:   the remainder                               (trainforge.ledger.books)

Figures: goodput = productive / wall; the seconds checkpoints were written in the background
(beside the steps, so in no bucket); tokens/s per device (torchtitan's ``tps``) over the
productive step time; TFLOP/s per device and MFU (trainforge.ledger.devices); GPU-hours
allocated (the wall time x GPUs: the same window) and productive; energy, every attempt's record
summed, or estimated over the same GPU-hours (trainforge.ledger.energy); the allocated cost over
the same hours (trainforge.ledger.catalog). The tag ``compile/mode`` says whether the throughput
figures are those of compiled steps.
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
from trainforge.ledger.disruptions import disruption_figures, event_disruption
from trainforge.ledger.energy import job_energy
from trainforge.pipeline.spec import PipelineSpec


@dataclass
class Ledger:
    """What is logged: metrics (numbers), tags (sources, and why a figure is missing)."""

    books: Books
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    window: dict[str, Any] = field(default_factory=dict)
    """``{"start", "end"}`` (epoch s) and the ``tries`` it spans: goodput's, GPU-hours', energy's
    and cost's one window."""

    def to_json(self) -> dict[str, Any]:
        """The ``ledger.json`` artifact (docs/contracts.md, "Run ledger")."""
        return {"schema": n.SCHEMA, "metrics": self.metrics, "tags": self.tags,
                "buckets_s": self.books.buckets, "unknown": self.books.unknown,
                "wall_s": self.books.wall_s, "productive_s": self.books.productive_s,
                "window": self.window}


def build_ledger(spec: PipelineSpec, event: dict[str, Any], run_tags: dict[str, str],
                 price: Price | str, *, task_started_s: float | None, now_s: float,
                 submitted_by_this_try: bool, earlier_tries: list[dict[str, Any]] | None = None,
                 try_number: int | None = None) -> Ledger:
    """The ledger of the job that ``event`` (the trigger's event of this try) reports, over
    every attempt of every try.

    Args:
        run_tags: the tags of the MLflow run the trainer logged into (its attempt records).
        price: `trainforge.ledger.catalog.choose_price`'s answer.
        task_started_s: when this try of the task first started (epoch s), if known.
        submitted_by_this_try: this try launched the job (else it adopted an earlier try's).
        earlier_tries: the earlier tries' records (trainforge.ledger.tries), oldest first.
        try_number: this try's number (names it among the disruptions).
    """
    records = attempt_records(run_tags)
    trainer = sum_attempts(records)
    handle = event.get("handle") or {}
    submitted = handle.get("submitted_at_epoch_s")
    job_end = event.get("ended_at_epoch_s") or trainer.last_record or now_s
    current = {"task_started_at": task_started_s, "submitted_at": submitted, "ended_at": now_s,
               "submitted_by_this_try": submitted_by_this_try, "job_ended_at": job_end,
               "phases": event.get("phases") or {}, "try": try_number,
               "disruption": event_disruption(event),
               "restarts": (event.get("result") or {}).get("restarts") or []}  # in-job, of any end
    tries = [*(earlier_tries or []), current]
    start = min([float(x) for t in tries for x in (t.get("task_started_at"), t.get("submitted_at"))
                 if x is not None] + [now_s, trainer.first_start or now_s])
    buckets: dict[str, float | str] = dict(trainer.buckets)
    buckets.update(_orchestrator_buckets(spec, tries, trainer.first_start, trainer.last_record,
                                         buckets))
    if not records:
        for name in trainer.buckets:
            buckets[name] = "unknown: the trainer left no attempt record (no MLflow tracking)"
    books = close_books(now_s - start, trainer.productive_s, buckets)
    ledger = Ledger(books, window={"start": start, "end": now_s, "tries": len(tries),
                                   "attempts": len(records)})
    m, t = ledger.metrics, ledger.tags
    m[n.WALL_S], m[n.PRODUCTIVE_S], m[n.GOODPUT] = books.wall_s, books.productive_s, books.goodput_pct
    m.update({n.badput(k): v for k, v in books.buckets.items()})
    t.update({n.unknown_tag(k): why for k, why in books.unknown.items()})
    m[n.DISRUPTIONS] = float(max(0, len(records) - 1))
    # node_loss, ... and the steps each one recomputed (trainforge.ledger.disruptions)
    kinds_m, kinds_t = disruption_figures(tries, records=records)
    m.update(kinds_m)
    t.update(kinds_t)
    if trainer.background_save_s is not None:  # a trainer from before background writes records none
        m[n.CHECKPOINT_BACKGROUND_S] = trainer.background_save_s
    if trainer.recoveries_s:
        m[n.RECOVERY_MEAN_S] = statistics.mean(trainer.recoveries_s)
        m[n.RECOVERY_MAX_S] = max(trainer.recoveries_s)
    _throughput(ledger, trainer.productive_tokens, trainer.productive_s, trainer.world_size,
                trainer.flops_per_token, trainer.device)
    if trainer.compiled is not None:  # what the throughput figures measured
        t[n.COMPILE_MODE] = trainer.compiled
    if trainer.staging is not None:  # how checkpoints were kept while written (trainer/host_memory.py)
        t[n.CHECKPOINT_STAGING] = trainer.staging
    _usage(ledger, spec, records, books.wall_s, price)  # the window goodput is over
    return ledger


def _orchestrator_buckets(spec: PipelineSpec, tries: list[dict[str, Any]], first: float | None,
                          last: float | None, buckets: dict[str, float | str]
                          ) -> dict[str, float | str]:
    """``orchestration``, ``queue_wait`` and ``image_pull`` over every try (the last one this
    try), and ``recovery`` less what of them lies between two attempts (each second counted once,
    under its own name): a try's start to its submission and its job's end to its own end are
    orchestration; the engine's phases are the job's."""
    out: dict[str, float | str] = {"orchestration": 0.0}
    parts: list[tuple[float, float]] = []  # (when, seconds) of every part counted
    now_phases = tries[-1]["phases"]
    for name in ("queue_wait", "image_pull"):
        if isinstance(now_phases.get(name), (int, float)):
            out[name] = 0.0
        else:
            out[name] = now_phases.get(name) or f"unknown: the {spec.training.engine} engine did not say"
    for t in tries:
        started, submitted = t.get("task_started_at"), t.get("submitted_at")
        pieces = [("orchestration", started, (submitted or 0) - (started or 0)
                   if t.get("submitted_by_this_try") and submitted and started else 0.0),
                  ("orchestration", t.get("job_ended_at"),
                   t["ended_at"] - t["job_ended_at"] if t.get("ended_at") and t.get("job_ended_at") else 0.0)]
        pieces += [(k, submitted or started, v) for k, v in (t.get("phases") or {}).items()
                   if k in ("queue_wait", "image_pull") and isinstance(v, (int, float))]
        for name, when, seconds in pieces:
            if isinstance(out[name], str) or not seconds or seconds < 0:
                continue
            out[name] = float(out[name]) + float(seconds)
            parts.append((float(when or 0.0), float(seconds)))
    if first is not None and last is not None:
        # between a failed attempt's last record and the next attempt's start: already recovery
        overlap = sum(s for when, s in parts if first < when < last)
        out["recovery"] = max(0.0, float(buckets["recovery"]) - overlap)
    return out


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
    """GPU-hours, energy and cost; allocated time is the ledger's wall time (goodput's window)."""
    res = spec.training.resources
    m, t = ledger.metrics, ledger.tags
    hours = max(0.0, allocated_s) / 3600.0
    gpu_hours = hours * res.max_nodes * res.gpus_per_node
    cpu_core_hours = hours * res.max_nodes * res.processes_per_node * res.cpus_per_process
    m[n.GPU_HOURS_ALLOCATED] = gpu_hours
    m[n.GPU_HOURS_PRODUCTIVE] = (ledger.books.productive_s / 3600.0 * res.max_nodes
                                 * res.gpus_per_node)
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
    m[n.COST_ALLOCATED] = price.cost(hours * res.max_nodes, gpu_hours, cpu_core_hours)
    t.update({"cost/currency": price.currency, "cost/price_source": price.source,
              "cost/price_date": price.date})
