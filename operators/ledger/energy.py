"""A job's energy per device kind: measured by the trainer where its machine allowed, else estimated.

A kind (``gpu``, ``cpu``) is *measured* when every attempt record of the run carries rank 0's
reading of it (trainforge.trainer.energy: NVML for GPUs, RAPL for CPU packages); rank 0 reads
its own machine, so the job's figure is that reading times ``training.resources.nodes``. It
covers the attempts' lifetimes; what lies between attempts is not counted. Otherwise the kind
is *estimated* from the spec's average power and the allocated device-hours::

    gpu kWh = gpu_hours x cost.gpu_power_watts / 1000
    cpu kWh = cpu_core_hours x cost.cpu_core_power_watts / 1000
"""

from __future__ import annotations

from typing import Any

from trainforge.pipeline.model import PipelineSpec

ESTIMATED = "estimated"
JOULES_PER_KWH = 3.6e6


def energy_kwh(spec: PipelineSpec, records: list[dict[str, Any]], gpu_hours: float,
               cpu_core_hours: float) -> tuple[dict[str, float], dict[str, str]]:
    """``({kind: kWh}, {kind: source})`` for the job's device kinds (``gpu`` only with GPUs)."""
    res, cost = spec.training.resources, spec.cost
    estimates = {"cpu": cpu_core_hours * cost.cpu_core_power_watts / 1000.0}
    if res.gpus_per_node:
        estimates["gpu"] = gpu_hours * cost.gpu_power_watts / 1000.0
    kwh, sources = {}, {}
    for kind, estimate in estimates.items():
        measured = [r for r in records if kind in (r.get("energy_source") or {})
                    and kind in (r.get("energy_j") or {})]
        if records and len(measured) == len(records):
            sources[kind] = str(measured[-1]["energy_source"][kind])
            kwh[kind] = sum(float(r["energy_j"][kind]) for r in measured) * res.nodes / JOULES_PER_KWH
        else:
            sources[kind], kwh[kind] = ESTIMATED, estimate
    return kwh, sources
