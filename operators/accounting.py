"""Accounting of one training launch: device-hours, cost and energy, from its wall time.

    gpu_hours = wall_s / 3600 x max_nodes x gpus_per_node
    cpu_core_hours = wall_s / 3600 x max_nodes x processes_per_node x cpus_per_process
    cost = the job's price (trainforge.ledger.catalog) for wall_s / 3600 x max_nodes machine-hours,
           or gpu_hours x gpu_hour_price + cpu_core_hours x cpu_hour_price (per-device prices)
    energy_kwh = (gpu_hours x gpu_power_watts + cpu_core_hours x cpu_core_power_watts) / 1000

The ``train`` task passes the run ledger's window (trainforge.ledger.build: the first try's
start to the successful try's end, every attempt and retry included), so time lost to killed
attempts and failed tries is counted, as it is billed, over the same window as goodput; the
engine's wall time of the last job only when no ledger could be built. Power figures are the
spec's averages, not measurements; the run ledger measures energy where the machine allows and
says where time went.
"""

from __future__ import annotations

from trainforge.ledger.catalog import Price
from trainforge.pipeline.spec import PipelineSpec


def account(spec: PipelineSpec, wall_s: float, price: Price | str | None = None) -> dict[str, float]:
    """Device-hours, cost and energy (kWh) of a launch.

    Args:
        price: the job's price (`trainforge.ledger.catalog.choose_price`); None or a reason
            (no price known): the spec's per-device prices, in ``spec.cost.currency``.
    """
    res, cost = spec.training.resources, spec.cost
    hours = max(0.0, float(wall_s)) / 3600.0
    # An elastic job (resources.nodes: {min, max}) is allocated, and billed, on its most nodes.
    gpu_hours = hours * res.max_nodes * res.gpus_per_node
    cpu_core_hours = hours * res.max_nodes * res.processes_per_node * res.cpus_per_process
    if not isinstance(price, Price):
        price = Price(cost.currency, "spec", "spec", per_gpu_hour=cost.gpu_hour_price,
                      per_cpu_core_hour=cost.cpu_hour_price)
    return {
        "wall_s": float(wall_s),
        "gpu_hours": gpu_hours,
        "cpu_core_hours": cpu_core_hours,
        "cost": price.cost(hours * res.max_nodes, gpu_hours, cpu_core_hours),
        "energy_kwh": (gpu_hours * cost.gpu_power_watts
                       + cpu_core_hours * cost.cpu_core_power_watts) / 1000.0,
    }
