"""Why a try's job failed, as a disruption kind the ledger attributes its badput to.

An engine that knows why a job failed says so in the failed status's result, under
``"disruption"``: ``{"kind": "node_loss", "node": str, "source": str, "lost_at": s,
"detected_at": s, "detection_s": s, ...}`` (the Slurm engine:
trainforge.engines.slurm.node_loss). The try's record (trainforge.ledger.tries) keeps it, so the
ledger of every later try still knows which tries ended in which kind of disruption.

The ledger then has, per kind over every try so far: ``disruptions/<kind>`` (how many tries
ended so), ``disruptions/<kind>/detection_max_s`` (the longest loss-to-report time), and the tag
``ledger/disruptions/<kind>`` naming each one (``try 1: h1, reported 1.2 s after its last sign
of life``). The recovery and wasted progress after such a try (trainforge.ledger.attempts) are
that kind's badput.
"""

from __future__ import annotations

from typing import Any

NODE_LOSS = "node_loss"
KINDS = (NODE_LOSS,)


def event_disruption(event: dict[str, Any]) -> dict[str, Any] | None:
    """The disruption a try's event reports (its job's result's ``disruption``), or None."""
    found = (event.get("result") or {}).get("disruption") if isinstance(event, dict) else None
    if isinstance(found, dict) and found.get("kind") in KINDS:
        return dict(found)
    return None


def disruption_figures(tries: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, str]]:
    """``(metrics, tags)`` of the tries' disruptions (module docstring); ``tries``: try records
    (or the current try's), each with ``try`` and maybe ``disruption``."""
    metrics: dict[str, float] = {}
    said: dict[str, list[str]] = {}
    for t in tries:
        d = t.get("disruption")
        if not isinstance(d, dict) or d.get("kind") not in KINDS:
            continue
        kind = d["kind"]
        metrics[f"disruptions/{kind}"] = metrics.get(f"disruptions/{kind}", 0.0) + 1.0
        detection = d.get("detection_s")
        if isinstance(detection, (int, float)):
            key = f"disruptions/{kind}/detection_max_s"
            metrics[key] = max(metrics.get(key, 0.0), float(detection))
        seconds = f", reported {float(detection):.1f} s after its last sign of life" \
            if isinstance(detection, (int, float)) else ""
        said.setdefault(kind, []).append(f"try {t.get('try')}: {d.get('node')}{seconds}")
    return metrics, {f"ledger/disruptions/{k}": "; ".join(v) for k, v in said.items()}
