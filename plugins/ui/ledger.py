"""The run ledger's figures as MLflow holds them, read generically.

The ledger logs ``goodput/percent``, ``badput/<bucket>_s`` (any bucket), ``gpu_hours/allocated``,
``gpu_hours/productive``, ``energy/kwh``, ``cost/allocated``, ``tps``, ``mfu_pct``,
``disruptions/count``, ``recovery/mean_s``, ``recovery/max_s`` and the tags
``energy/source/<device>`` (a kind, ``gpu`` or ``cpu``, or one GPU, ``gpu1``: ``measured-nvml`` |
``power_integration`` | ``measured-rapl`` | ``estimated`` | ``unknown`` | ``mixed``),
``energy/reason/<device>`` (why estimated or unknown), ``energy/status`` and ``cost/status``
(``complete`` | ``partial``). Runs from
before the ledger carry the train task's accounting instead (trainforge.accounting, logged as
``accounting/[<stage>/]<name>``): GPU-hours, cost and energy estimated from wall time and the
spec's power figures. Whatever exists is shown; nothing is invented.
"""

from __future__ import annotations

import re
from typing import Any

_BADPUT = re.compile(r"^badput/(?P<bucket>.+)_s$")
_ACCOUNTING = re.compile(r"^accounting/(?:(?P<stage>[^/]+)/)?(?P<name>[^/]+)$")
LEDGER_FIGURES = ("goodput/percent", "gpu_hours/allocated", "gpu_hours/productive", "energy/kwh",
                  "cost/allocated", "tps", "mfu_pct", "disruptions/count", "recovery/mean_s",
                  "recovery/max_s")


def badput(metrics: dict[str, float]) -> dict[str, float]:
    """Seconds lost per bucket (every ``badput/<bucket>_s`` metric)."""
    return {m["bucket"]: float(v) for k, v in metrics.items() if (m := _BADPUT.match(k))}


def accounting(metrics: dict[str, float]) -> dict[str, float]:
    """The train task's accounting summed over its stages (``accounting/[<stage>/]<name>``)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if (m := _ACCOUNTING.match(key)) and value is not None:
            out[m["name"]] = out.get(m["name"], 0.0) + float(value)
    return out


def energy_sources(tags: dict[str, str], prefix: str = "energy/source/") -> dict[str, str]:
    """``energy/source/<device>`` tags: how each device's energy was obtained (``prefix``
    ``energy/reason/``: why it is estimated or unknown)."""
    return {k[len(prefix):]: v for k, v in tags.items() if k.startswith(prefix)}


def figures(metrics: dict[str, float], tags: dict[str, str]) -> dict[str, Any]:
    """One run's goodput, GPU-hours, cost and energy: the ledger's when logged, else the
    accounting's (marked ``estimated``)."""
    acc = accounting(metrics)
    sources = energy_sources(tags)
    ledger = {k: metrics[k] for k in LEDGER_FIGURES if metrics.get(k) is not None}
    return {
        "ledger": bool(ledger),
        "goodput_percent": ledger.get("goodput/percent"),
        "badput_s": badput(metrics),
        "gpu_hours": ledger.get("gpu_hours/allocated", acc.get("gpu_hours")),
        "gpu_hours_productive": ledger.get("gpu_hours/productive"),
        "cost": ledger.get("cost/allocated", acc.get("cost")),
        "energy_kwh": ledger.get("energy/kwh", acc.get("energy_kwh")),
        "energy_source": sources or ({"all": "estimated"} if acc.get("energy_kwh") is not None
                                     else {}),
        "energy_reason": energy_sources(tags, "energy/reason/"),
        "energy_status": tags.get("energy/status"),
        "cost_status": tags.get("cost/status"),
        "wall_s": acc.get("wall_s"),
        "tps": ledger.get("tps"),
        "mfu_pct": ledger.get("mfu_pct"),
        "disruptions": ledger.get("disruptions/count"),
        "recovery_mean_s": ledger.get("recovery/mean_s"),
        "recovery_max_s": ledger.get("recovery/max_s"),
    }
