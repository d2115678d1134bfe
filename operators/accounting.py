"""Accounting of one training launch: device-hours, cost and energy, from its wall time.

    gpu_hours = wall_s / 3600 x nodes x gpus_per_node
    cpu_core_hours = wall_s / 3600 x nodes x processes_per_node x cpus_per_process
    cost = gpu_hours x gpu_hour_price + cpu_core_hours x cpu_hour_price
    energy_kwh = (gpu_hours x gpu_power_watts + cpu_core_hours x cpu_core_power_watts) / 1000

Wall time is the engine's (job start to end, restarts included), so time lost to failures is
counted, as it is billed. Power figures are the spec's averages, not measurements.
"""

from __future__ import annotations

from trainforge.pipeline.model import PipelineSpec


def account(spec: PipelineSpec, wall_s: float) -> dict[str, float]:
    """Device-hours, cost (in ``spec.cost.currency``) and energy (kWh) of a launch."""
    res, cost = spec.training.resources, spec.cost
    hours = max(0.0, float(wall_s)) / 3600.0
    gpu_hours = hours * res.nodes * res.gpus_per_node
    cpu_core_hours = hours * res.nodes * res.processes_per_node * res.cpus_per_process
    return {
        "wall_s": float(wall_s),
        "gpu_hours": gpu_hours,
        "cpu_core_hours": cpu_core_hours,
        "cost": gpu_hours * cost.gpu_hour_price + cpu_core_hours * cost.cpu_hour_price,
        "energy_kwh": (gpu_hours * cost.gpu_power_watts
                       + cpu_core_hours * cost.cpu_core_power_watts) / 1000.0,
    }
