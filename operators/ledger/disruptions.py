"""Why a try's job failed or shrank, as a disruption kind the ledger attributes its badput to.

An engine that knows why a job failed says so in the status's result, under ``"disruption"``:
``{"kind": "node_loss", "node": str, "source": str, "lost_at": s, "detected_at": s,
"detection_s": s, ...}`` (the Slurm engine: trainforge.engines.slurm.node_loss); a job that lost
a node and went on with the survivors says so in its succeeded status's. A job whose worker group
restarted inside it lists each restart under ``"restarts"``, kind ``restart``, whatever its end. The try's record
(trainforge.ledger.tries) keeps it, so the ledger of every later try still knows it.

The ledger then has, per kind over every try so far: ``disruptions/<kind>`` (how many),
``disruptions/<kind>/detection_max_s`` (the longest loss-to-report time),
``disruptions/<kind>/steps_recomputed`` and the tag ``ledger/disruptions/<kind>`` naming each one
(``try 1: h1, reported 1.2 s after its last sign of life, 7 steps recomputed``). A disruption's
steps recomputed are those of the first attempt that started after its ``lost_at``: from the step
it resumed at to the furthest step reached before (``reached_step - resumed_step``); unknown, so
neither summed nor said, until such an attempt has a record. The recovery and wasted progress
after such a try (trainforge.ledger.attempts) are that kind's badput.
"""

from __future__ import annotations

from typing import Any

NODE_LOSS = "node_loss"
RESTART = "restart"
"""An in-job restart of the worker group (the result's ``restarts``: trainforge.engines.root_cause),
with the rank and host that caused it as its ``node`` and ``rank``."""
KINDS = (NODE_LOSS, RESTART)


def event_disruption(event: dict[str, Any]) -> dict[str, Any] | None:
    """The disruption a try's event reports (its job's result's ``disruption``), or None."""
    found = (event.get("result") or {}).get("disruption") if isinstance(event, dict) else None
    if isinstance(found, dict) and found.get("kind") in KINDS:
        return dict(found)
    return None


def disruption_figures(tries: list[dict[str, Any]], *,
                       records: list[dict[str, Any]] | None = None
                       ) -> tuple[dict[str, float], dict[str, str]]:
    """``(metrics, tags)`` of the tries' disruptions (module docstring); ``tries``: try records
    (or the current try's), each with ``try`` and maybe ``disruption``; ``records``: the
    trainer's attempt records (trainforge.ledger.attempts), for the steps recomputed."""
    metrics: dict[str, float] = {}
    said: dict[str, list[str]] = {}
    for t, d in [(t, d) for t in tries for d in [t.get("disruption"), *(t.get("restarts") or [])]]:
        if not isinstance(d, dict) or d.get("kind") not in KINDS:
            continue
        kind = d["kind"]
        metrics[f"disruptions/{kind}"] = metrics.get(f"disruptions/{kind}", 0.0) + 1.0
        detection = d.get("detection_s")
        if isinstance(detection, (int, float)):
            key = f"disruptions/{kind}/detection_max_s"
            metrics[key] = max(metrics.get(key, 0.0), float(detection))
        if kind == RESTART:  # which restart, what caused it, how soon the group restarted
            text = f"try {t.get('try')}, restart {d.get('index')}: {d.get('cause') or d.get('node')}"
            if isinstance(detection, (int, float)):
                text += f"; restarted {float(detection):.1f} s after"
        else:
            text = f"try {t.get('try')}: {d.get('node')}"
            if isinstance(detection, (int, float)):
                text += f", reported {float(detection):.1f} s after its last sign of life"
        steps = steps_recomputed(d, records or [])
        if steps is not None:
            key = f"disruptions/{kind}/steps_recomputed"
            metrics[key] = metrics.get(key, 0.0) + float(steps)
            text += f", {steps} step{'' if steps == 1 else 's'} recomputed"
        said.setdefault(kind, []).append(text)
    return metrics, {f"ledger/disruptions/{k}": "; ".join(v) for k, v in said.items()}


def steps_recomputed(disruption: dict[str, Any], records: list[dict[str, Any]]) -> int | None:
    """The steps the first attempt started after the disruption's ``lost_at`` trained again
    (``reached_step - resumed_step``, at least 0); None when unknown: no ``lost_at``, no such
    attempt yet, or its record has no step numbers (a trainer from before they were recorded)."""
    lost_at = disruption.get("lost_at")
    if not _number(lost_at):
        return None
    later = [r for r in records if _number(r.get("started_at")) and r["started_at"] > lost_at]
    if not later:
        return None
    first = min(later, key=lambda r: float(r["started_at"]))
    reached, resumed = first.get("reached_step"), first.get("resumed_step")
    if not (_number(reached) and _number(resumed)):
        return None
    return max(0, int(reached) - int(resumed))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
