"""A job's energy per device kind and per GPU device, from what the trainer could read, else the
spec's estimate, else unknown: never a 0 that means "not read".

**GPU**, when every attempt record read the job's GPUs (trainforge.trainer.gpus: each local
rank's device found by UUID, never a neighbour's by index), per device (``gpu<NVML index>``,
``gpu<index>-mig<k>``, ``cuda<r>`` for a rank's device NVML could not identify):

* ``measured-nvml``: NVML's total-energy counter;
* ``power_integration``: NVML's power readings, integrated;
* ``unknown``: NVML read neither (a MIG instance, most vGPUs), or the device is not identified,
  with the reason. Such a device is not estimated: the spec's per-GPU power is a whole board's,
  and it is a share of one, or a board that cannot be told.

Over several attempts a device keeps its weakest source; the ``gpu`` kind's is its devices'
one source, or ``mixed`` (docs/contracts.md, "Run ledger").

When an attempt read no GPU at all, or there is no attempt record, the ``gpu`` kind is
``estimated`` from the spec, with the reason, as ``gpu_hours x cost.gpu_power_watts / 1000``.

**CPU**: ``measured-rapl`` when every attempt record read RAPL, else ``estimated`` (with the
reason) as ``cpu_core_hours x cost.cpu_core_power_watts / 1000``.

A power figure of 0 W gives no estimate: that kind is ``unknown``. Rank 0 reads its own machine,
so a measured figure is its reading times ``resources.max_nodes``. The energy, and the cost
billed with it, are ``partial`` when any kind or device is ``estimated`` or ``unknown``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainforge.pipeline.spec import PipelineSpec

MEASURED_NVML = "measured-nvml"
POWER_INTEGRATION = "power_integration"
ESTIMATED = "estimated"
UNKNOWN = "unknown"
MIXED = "mixed"
COMPLETE = "complete"
PARTIAL = "partial"
JOULES_PER_KWH = 3.6e6
_RANK = {UNKNOWN: 0, ESTIMATED: 1, POWER_INTEGRATION: 2}  # weakest first; measured ones above


@dataclass
class JobEnergy:
    """The job's energy: kWh per kind read or estimated, the source and the reason (when
    estimated or unknown) per kind (``gpu``, ``cpu``) and per GPU device (``gpu1``)."""

    kwh: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    device_kwh: dict[str, float] = field(default_factory=dict)
    """Rank 0's machine's reading per GPU device read in every attempt (not times nodes)."""

    @property
    def status(self) -> str:
        """``partial`` when a kind or device is estimated or unknown, else ``complete``."""
        return PARTIAL if set(self.sources.values()) & {ESTIMATED, UNKNOWN} else COMPLETE


def _gpu_devices(record: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The record's GPU devices (``gpus``), a trainer-wide reading as one device named ``gpu``
    (records from before per-device metering), or None when it read no GPU."""
    if record.get("gpus"):
        return record["gpus"]
    source = (record.get("energy_source") or {}).get("gpu")
    joules = (record.get("energy_j") or {}).get("gpu")
    if source is not None and joules is not None:
        return {"gpu": {"source": str(source), "energy_j": float(joules)}}
    return None


def _weakest(sources: list[str]) -> str:
    return min(sources, key=lambda s: _RANK.get(s, 3))


def _unread(records: list[dict[str, Any]], kind: str, has: list[bool]) -> str:
    """Why ``kind`` was not read in every attempt (the records' ``energy_unread`` reasons)."""
    if not records:
        return "the trainer left no attempt record (no MLflow tracking)"
    missing = [r for r, ok in zip(records, has) if not ok]
    why = sorted({str((r.get("energy_unread") or {}).get(kind) or "the trainer recorded no "
                      "reason (a trainer from before per-device records)") for r in missing})
    return f"{len(missing)} of {len(records)} attempt(s) read no {kind.upper()} energy: " + "; ".join(why)


def _estimate(out: JobEnergy, kind: str, hours: float, watts: float, what: str, unit: str,
              why: str) -> None:
    if watts > 0:
        out.sources[kind], out.kwh[kind] = ESTIMATED, hours * watts / 1000.0
        out.reasons[kind] = f"{why}; estimated as the spec's {what} {watts:g} W x {hours:.4g} {unit}"
    else:
        out.sources[kind] = UNKNOWN
        out.reasons[kind] = f"{why}; the spec's {what} is 0 W, so there is no estimate either"


def _gpus(out: JobEnergy, per_record: list[dict[str, dict[str, Any]]], nodes: int) -> None:
    """The ``gpu`` kind from every attempt's device readings (module docstring)."""
    seen: dict[str, list[dict[str, Any]]] = {}
    for devices in per_record:
        for key, entry in devices.items():
            seen.setdefault(str(key), []).append(entry)
    joules, read_any, kinds = 0.0, False, set()
    for key, entries in seen.items():
        read = [float(e["energy_j"]) for e in entries
                if e.get("source") not in (None, UNKNOWN) and e.get("energy_j") is not None]
        source = _weakest([str(e["source"]) for e in entries]) if len(read) == len(entries) else UNKNOWN
        joules, read_any = joules + sum(read), read_any or bool(read)
        kinds.add(source)
        if key == "gpu":
            continue  # a trainer-wide reading (module docstring): the kind's own figure
        out.sources[key] = source
        if source == UNKNOWN:
            out.reasons[key] = next((str(e["reason"]) for e in entries if e.get("reason")),
                                    "an attempt recorded no reading of it")
        else:
            out.device_kwh[key] = sum(read) / JOULES_PER_KWH
    out.sources["gpu"] = kinds.pop() if len(kinds) == 1 else MIXED
    if read_any:
        out.kwh["gpu"] = joules * nodes / JOULES_PER_KWH
    else:
        out.reasons["gpu"] = "NVML read none of the job's GPUs (each device's reason says why)"


def job_energy(spec: PipelineSpec, records: list[dict[str, Any]], gpu_hours: float,
               cpu_core_hours: float) -> JobEnergy:
    """The job's :class:`JobEnergy` from its attempt records (oldest first) and allocated hours;
    ``gpu`` only with GPUs."""
    res, cost = spec.training.resources, spec.cost
    out = JobEnergy()
    if res.gpus_per_node:
        per_record = [_gpu_devices(r) for r in records]
        has = [d is not None for d in per_record]
        if records and all(has):  # an elastic job is counted on its allocation's most nodes
            _gpus(out, [d for d in per_record if d is not None], res.max_nodes)
        else:
            _estimate(out, "gpu", gpu_hours, cost.gpu_power_watts, "cost.gpu_power_watts", "GPU-h",
                      _unread(records, "gpu", has))
    has = [r.get("energy_source", {}).get("cpu") is not None and "cpu" in (r.get("energy_j") or {})
           for r in records]
    if records and all(has):
        out.sources["cpu"] = str(records[-1]["energy_source"]["cpu"])
        out.kwh["cpu"] = sum(float(r["energy_j"]["cpu"]) for r in records) * res.max_nodes / JOULES_PER_KWH
    else:
        _estimate(out, "cpu", cpu_core_hours, cost.cpu_core_power_watts, "cost.cpu_core_power_watts",
                  "CPU-core-h", _unread(records, "cpu", has))
    return out


def energy_kwh(spec: PipelineSpec, records: list[dict[str, Any]], gpu_hours: float,
               cpu_core_hours: float) -> tuple[dict[str, float], dict[str, str]]:
    """``({kind: kWh}, {kind: source})``: :func:`job_energy` per device kind only."""
    energy = job_energy(spec, records, gpu_hours, cpu_core_hours)
    return energy.kwh, {k: v for k, v in energy.sources.items() if k in ("gpu", "cpu")}
