"""``registry.eval`` for the ``register_model`` task: the evaluator's task options from the spec,
the gate's rules, and the per-prompt results as an MLflow table and as model-card lines.

Pure and cheap to import (no torch, no MLflow calls); the scoring itself is
trainforge.trainer.task_eval, run inside the gate's evaluator child process (docs/registry.md).
"""

from __future__ import annotations

from typing import Any

from trainforge.gate import TaskRules
from trainforge.paths import resolve

#: Generations the model card shows next to their expected answers.
CARD_EXAMPLES = 5
#: Characters of a prompt, answer or expected text in a card cell.
_CELL_CHARS = 120


def task_options(spec) -> dict[str, Any] | None:
    """``evaluator_argv``'s ``task`` for ``spec`` (paths resolved against TRAINFORGE_HOME), or
    None without ``registry.eval``. The template: ``registry.eval.chat_template``, else
    ``data.chat_template``, else None (each model's own)."""
    task = spec.registry.eval
    if task is None:
        return None
    template = task.chat_template or spec.data.chat_template
    return {"prompts": resolve(task.prompts), "scoring": task.scoring,
            "max_new_tokens": task.max_new_tokens, "chat_template": resolve(template) if template else None}


def task_rules(spec) -> TaskRules | None:
    """The gate's `TaskRules` of ``registry.eval``, or None without it."""
    task = spec.registry.eval
    if task is None:
        return None
    return TaskRules(require_at_least_champion=task.require_at_least_champion, min_score=task.min_score)


def table_path(candidate_version: str, champion_version: str | None) -> str:
    """The run artifact of one comparison's table: named after both versions, since they (with
    the spec's prompts) determine its rows."""
    against = f"-vs-v{champion_version}" if champion_version else ""
    return f"gate/task_eval-v{candidate_version}{against}.json"


def table(evaluation: dict[str, Any], versions: dict[str, str]) -> dict[str, list[Any]]:
    """``{column: values}`` of every scored model's per-prompt results (``model``, ``version``,
    ``prompt``, ``expected``, ``generated``, ``correct``), candidate first."""
    columns: dict[str, list[Any]] = {k: [] for k in ("model", "version", "prompt", "expected", "generated",
                                                     "correct")}
    for name, entry in (evaluation.get("models") or {}).items():
        for row in (entry.get("task") or {}).get("results") or []:
            columns["model"].append(name)
            columns["version"].append(versions.get(name, ""))
            for key in ("prompt", "expected", "generated", "correct"):
                columns[key].append(row[key])
    return columns


def card_lines(entry: dict[str, Any] | None, scoring: str, limit: int = CARD_EXAMPLES) -> list[str]:
    """Markdown for the model card: the task score and the first ``limit`` generations next to
    their expected answers; nothing when the candidate was not scored."""
    if not entry or not entry.get("ok"):
        return []
    results = entry.get("results") or []
    lines = ["", f"## Task score: {entry['score']:.2f} ({entry['correct']}/{entry['total']} correct, "
                 f"{scoring})", "", "| prompt | expected | generated | correct |", "| --- | --- | --- | --- |"]
    lines += [f"| {_cell(r['prompt'])} | {_cell(r['expected'])} | {_cell(r['generated'])} | "
              f"{'yes' if r['correct'] else 'no'} |" for r in results[:limit]]
    if len(results) > limit:
        lines.append(f"\n{len(results) - limit} more in the MLflow run's gate table.")
    return lines


def _cell(text: str) -> str:
    """``text`` on one line in a Markdown table cell: pipes escaped, cut to `_CELL_CHARS`."""
    flat = " ".join(str(text).split()).replace("|", "\\|") or "(empty)"
    return flat if len(flat) <= _CELL_CHARS else flat[: _CELL_CHARS - 1] + "…"
