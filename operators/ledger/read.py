"""A run's ledger read back from its MLflow metrics and tags (the run summary, the report).

A spec without stages has the ledger under its own names on the DAG run's run; a stage's is on
its child run under its own names and on the DAG run's run under ``stage/<stage>/<name>``.
"""

from __future__ import annotations

from typing import Any

from trainforge.ledger import names as n

FIGURES = (n.GOODPUT, n.WALL_S, n.PRODUCTIVE_S, n.GPU_HOURS_ALLOCATED, n.GPU_HOURS_PRODUCTIVE,
           n.ENERGY_KWH, n.COST_ALLOCATED, n.TPS, n.TFLOPS, n.MFU_PCT, n.DISRUPTIONS,
           n.RECOVERY_MEAN_S, n.RECOVERY_MAX_S, n.CHECKPOINT_BACKGROUND_S)


def ledger_figures(metrics: dict[str, float], tags: dict[str, str],
                   stage: str | None = None) -> dict[str, Any] | None:
    """``{"figures": {name: value}, "badput": {bucket: s}, "tags": {...}}`` of one ledger, or
    None when the run holds none."""
    prefix = f"stage/{stage}/" if stage else ""
    if prefix + n.GOODPUT not in metrics:
        return None
    figures = {name: metrics[prefix + name] for name in FIGURES if prefix + name in metrics}
    badput = {b: metrics[prefix + n.badput(b)] for b in n.BUCKETS if prefix + n.badput(b) in metrics}
    own = {k[len(prefix):]: v for k, v in tags.items() if k.startswith(prefix)
           and k[len(prefix):].split("/")[0] in ("ledger", "energy", "cost")}
    return {"figures": figures, "badput": badput, "tags": own}


def stage_names(metrics: dict[str, float]) -> list[str]:
    """The stages whose ledger the DAG run's run holds."""
    suffix = "/" + n.GOODPUT
    return sorted(k[len("stage/"):-len(suffix)] for k in metrics
                  if k.startswith("stage/") and k.endswith(suffix))


def energy_sources_line(tags: dict[str, str], sep: str = ", ", none: str = "-") -> str:
    """Each device kind's and GPU device's energy source, ``cpu measured-rapl, gpu mixed,
    gpu1 power_integration, gpu3 unknown`` (kinds first), or ``none`` when the ledger names none."""
    prefix = "energy/source/"
    found = {k[len(prefix):]: v for k, v in tags.items() if k.startswith(prefix)}
    order = sorted(found, key=lambda d: (d not in ("gpu", "cpu"), d))
    return sep.join(f"{d} {found[d]}" for d in order) or none


def ledger_line(ledger: dict[str, Any]) -> str:
    """One line of a ledger for the run summary."""
    f, t = ledger["figures"], ledger["tags"]

    def num(name: str, spec: str, unit: str = "") -> str:
        return "-" if name not in f else f"{format(f[name], spec)}{unit}"

    sources = energy_sources_line(t, sep="/", none="no source")
    if t.get(n.ENERGY_STATUS) == "partial":
        sources += ", partial"
    top = sorted(((v, k) for k, v in ledger["badput"].items() if v > 0), reverse=True)[:3]
    cost = (f"{num(n.COST_ALLOCATED, '.4f')} {t.get('cost/currency', '')}".strip()
            + (" (partial)" if t.get(n.COST_STATUS) == "partial" else "")
            if n.COST_ALLOCATED in f else "cost unknown")
    return (f"goodput {num(n.GOODPUT, '.1f', '%')} of {num(n.WALL_S, '.1f', ' s')}; "
            f"{num(n.GPU_HOURS_ALLOCATED, '.4f')} GPU-h allocated; {num(n.ENERGY_KWH, '.5f')} kWh "
            f"({sources}); {cost}; {num(n.TPS, ',.0f')} tok/s/device, "
            f"MFU {num(n.MFU_PCT, '.1f', '%')}; {num(n.DISRUPTIONS, '.0f')} disruption(s), "
            f"recovery mean {num(n.RECOVERY_MEAN_S, '.1f', ' s')} max "
            f"{num(n.RECOVERY_MAX_S, '.1f', ' s')}; top badput: "
            + (", ".join(f"{k} {v:.1f} s" for v, k in top) or "none"))
