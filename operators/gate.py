"""The eval gate: does a new model version take the ``champion`` alias? Pure decisions.

The ``register_model`` task registers the version (alias ``challenger``), then asks this module:

1. gate disabled (``validation.gate.enabled: false``) → ``skipped``: champion untouched;
2. the version is already the champion (a retry after the alias moved) → ``pass``;
3. the validated metrics miss an absolute threshold (``validation.max_val_loss``, ...) →
   ``fail``;
4. no champion yet (the first model ever) → ``pass``: it met every absolute threshold;
5. else candidate and champion are evaluated by ``python -m trainforge.trainer.evaluate`` in one child
   process on the same validation split (`evaluator_argv`); with equal tokenizers the spec's
   metric is compared, with different tokenizers ``val_bits_per_byte`` (`compare`).

Lower is better for every gate metric. ``improvement = (champion - candidate) / champion``;
the candidate passes when ``improvement >= min_improvement`` and ``improvement > 0``.

With ``registry.eval`` (`TaskRules`) the same child process also scores each model on the task
prompts (trainforge.trainer.task_eval), the candidate alone when there is no champion; a task
score below ``min_score`` or (``require_at_least_champion``) below the champion's fails before
the loss is compared, and a tie leaves the decision to the validation loss.

A ``fail`` is a normal outcome: the task succeeds, the version keeps ``challenger``, the reason is
in the version's and the run's ``trainforge.gate.*`` tags (docs/registry.md) and in XCom.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

GATE_TAG_PREFIX = "trainforge.gate."
PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
# Only bits per byte is comparable between models with different tokenizers.
CROSS_TOKENIZER_METRIC = "val_bits_per_byte"


@dataclass(frozen=True)
class TaskRules:
    """``registry.eval``'s gate rules as plain values (scores are fractions correct, 0..1)."""

    require_at_least_champion: bool = True
    min_score: float | None = None


@dataclass(frozen=True)
class GateDecision:
    """One gate outcome. Values are floats in the metric's unit, None when not measured."""

    decision: str  # PASS | FAIL | SKIPPED
    reason: str
    metric: str
    method: str  # "tokens" | "text" (trainforge.trainer.evaluate), "thresholds", "none"
    candidate_version: str
    candidate_value: float | None = None
    champion_version: str | None = None  # the champion compared against (before the gate)
    champion_value: float | None = None
    improvement: float | None = None  # relative: (champion - candidate) / champion
    min_improvement: float = 0.0
    champion_after: str | None = None  # filled in by the operator once aliases moved
    task_score: float | None = None  # registry.eval: the candidate's fraction correct, 0..1
    champion_task_score: float | None = None

    @property
    def promoted(self) -> bool:
        """True when the candidate takes (or already holds) the champion alias."""
        return self.decision == PASS

    def as_xcom(self) -> dict[str, Any]:
        return {**asdict(self), "promoted": self.promoted}

    def tags(self, with_champion_after: bool = True) -> dict[str, str]:
        """``trainforge.gate.<field>`` → text ("none" for missing values), for runs and versions.

        Version tags are written before the alias moves: they leave out ``champion_after``.
        """
        out = {}
        for key, value in asdict(self).items():
            if key == "champion_after" and not with_champion_after:
                continue
            if isinstance(value, float):
                value = f"{value:.6g}"
            out[f"{GATE_TAG_PREFIX}{key}"] = "none" if value is None else str(value)
        return out

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> GateDecision | None:
        """The decision recorded by `tags` on a model version, or None when there is none."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, text in tags.items():
            name = key[len(GATE_TAG_PREFIX):] if key.startswith(GATE_TAG_PREFIX) else None
            if name not in fields:
                continue
            if text == "none":
                values[name] = None
            elif name in ("candidate_value", "champion_value", "improvement", "min_improvement",
                          "task_score", "champion_task_score"):
                values[name] = float(text)
            else:
                values[name] = text
        try:
            return cls(**values)
        except TypeError:  # a required field is missing: no complete decision recorded
            return None

    def summary_line(self) -> str:
        """One plain sentence for the task log and the model card."""
        verdict = {PASS: "PASSED", FAIL: "FAILED", SKIPPED: "SKIPPED"}[self.decision]
        return f"eval gate {verdict} for v{self.candidate_version}: {self.reason}"


def compare(metric: str, candidate: float | None, champion: float | None,
            min_improvement: float) -> tuple[bool, float | None, str]:
    """``(passes, relative improvement, reason)`` of ``candidate`` against ``champion``.

    Lower is better. Missing or non-finite values never pass.
    """
    if candidate is None or not math.isfinite(candidate):
        return False, None, f"candidate {metric} is {candidate}: not a finite number"
    if champion is None or not math.isfinite(champion) or champion <= 0:
        return False, None, f"champion {metric} is {champion}: cannot compare against it"
    improvement = (champion - candidate) / champion
    needed = (f"needs at least {min_improvement:.2%} lower" if min_improvement > 0
              else "needs any improvement")
    text = (f"{metric} {candidate:.4f} vs champion {champion:.4f} "
            f"({improvement:+.2%} relative improvement; {needed})")
    if improvement > 0 and improvement >= min_improvement:
        return True, improvement, text
    return False, improvement, text


def decide(*, enabled: bool, metric: str, min_improvement: float, candidate_version: str,
           candidate_metrics: dict[str, Any], threshold_failures: list[str],
           champion_version: str | None, evaluation: dict[str, Any] | None = None,
           task: TaskRules | None = None) -> GateDecision:
    """The gate's decision (module doc, steps 1-5, and the task score with ``task``).

    Args:
        candidate_metrics: the validation report's metrics of the candidate (used for the
            thresholds and for the first model ever).
        threshold_failures: the spec's absolute thresholds the candidate misses.
        champion_version: the version ``champion`` points at now, None when there is none.
        evaluation: the ``trainforge.trainer.evaluate`` report with models ``candidate`` and ``champion``
            (needed when there is a champion other than the candidate, and with ``task``).
        task: ``registry.eval``'s rules; each model's ``task`` entry of ``evaluation`` is scored.
    Raises:
        ValueError: a champion to compare against, or task rules, but no evaluation (a
            programming error).
    """
    common = {"metric": metric, "candidate_version": str(candidate_version),
              "min_improvement": min_improvement, "champion_version": champion_version}
    value = candidate_metrics.get(metric)
    if not enabled:
        return GateDecision(SKIPPED, "validation.gate.enabled is false: champion is never moved "
                                     "automatically", method="none", candidate_value=value, **common)
    if champion_version is not None and str(champion_version) == str(candidate_version):
        return GateDecision(PASS, f"v{candidate_version} is already the champion", method="none",
                            candidate_value=value, **common)
    if threshold_failures:
        return GateDecision(FAIL, "misses absolute thresholds: " + "; ".join(threshold_failures),
                            method="thresholds", candidate_value=value, **common)
    if evaluation is None and (task is not None or champion_version is not None):
        raise ValueError("decide(): a champion or task rules exist, so the evaluation report is "
                         "required")
    models = (evaluation or {}).get("models") or {}
    cand, champ = models.get("candidate") or {}, models.get("champion") or {}
    score = None
    if task is not None:
        score, error = task_score(cand)
        common["task_score"] = score
        if score is None:
            return GateDecision(FAIL, f"the candidate's task score could not be measured: {error}",
                                method="task", candidate_value=value, **common)
        if task.min_score is not None and score < task.min_score:
            return GateDecision(FAIL, f"task score {_score(cand)} is below registry.eval.min_score "
                                      f"{task.min_score:.2f}", method="task", candidate_value=value,
                                **common)
    if champion_version is None:
        first = ("first version of this model and it meets every absolute threshold"
                 + (f"; task score {_score(cand)}" if score is not None else ""))
        return GateDecision(PASS, first, method="thresholds", candidate_value=value, **common)
    method = str(evaluation.get("method") or "none")
    if not champ.get("ok"):
        return GateDecision(FAIL, f"champion v{champion_version} could not be evaluated: "
                                  f"{champ.get('error')}; fix or move the champion alias by hand",
                            method=method, candidate_value=value, **common)
    prefix = ""
    if task is not None:
        champion_score, error = task_score(champ)
        common["champion_task_score"] = champion_score
        if task.require_at_least_champion and champion_score is None:
            return GateDecision(FAIL, f"champion v{champion_version}'s task score could not be "
                                      f"measured: {error}; fix or move the champion alias by hand, or "
                                      "set registry.eval.require_at_least_champion: false",
                                method="task", candidate_value=value, **common)
        if task.require_at_least_champion and score < champion_score:
            return GateDecision(FAIL, f"task score {_score(cand)} is below the champion's "
                                      f"{_score(champ)} (registry.eval.require_at_least_champion)",
                                method="task", candidate_value=value, **common)
        if score == champion_score:
            prefix = (f"task score {_score(cand)} equals the champion's {_score(champ)}; "
                      "the validation loss decided: ")
        else:
            prefix = f"task score {_score(cand)} vs the champion's {_score(champ)}; "
    used = metric if method == "tokens" else CROSS_TOKENIZER_METRIC
    c_value = (cand.get("metrics") or {}).get(used)
    h_value = (champ.get("metrics") or {}).get(used)
    ok, improvement, text = compare(used, c_value, h_value, min_improvement)
    if used != metric:
        text += f" (tokenizers differ: compared by {used}, not {metric})"
    common["metric"] = used
    return GateDecision(PASS if ok else FAIL, prefix + text, method=method, candidate_value=c_value,
                        champion_value=h_value, improvement=improvement, **common)


def task_score(entry: dict[str, Any]) -> tuple[float | None, str | None]:
    """``(fraction correct, None)`` from one model's evaluation entry, or ``(None, why not)``."""
    task = entry.get("task") or {}
    score = task.get("score")
    if task.get("ok") and isinstance(score, (int, float)) and math.isfinite(score):
        return float(score), None
    return None, task.get("error") or entry.get("error") or "no task score in the evaluation report"


def _score(entry: dict[str, Any]) -> str:
    """``0.60 (3/5)``: a model's task score and its counts, for reasons."""
    task = entry.get("task") or {}
    if task_score(entry)[0] is None:
        return "not measured"
    return f"{task['score']:.2f} ({task.get('correct')}/{task.get('total')})"


def evaluator_argv(python: str, dataset_dir: str, models: dict[str, str], report_path: str,
                   max_eval_tokens: int, task: dict[str, Any] | None = None) -> list[str]:
    """Pure: ``python -m trainforge.trainer.evaluate`` for ``{name: model URI}`` on one dataset.

    ``task``: ``{"prompts": file, "scoring", "max_new_tokens", "chat_template": file or None}``
    (local paths) to score each model on the task prompts too.
    """
    argv = [python, "-m", "trainforge.trainer.evaluate", "--dataset", dataset_dir, "--report", report_path,
            "--max-eval-tokens", str(max_eval_tokens)]
    for name, uri in models.items():
        argv += ["--model", f"{name}={uri}"]
    if task is not None:
        argv += ["--prompts", task["prompts"], "--scoring", task["scoring"],
                 "--max-new-tokens", str(task["max_new_tokens"])]
        if task.get("chat_template"):
            argv += ["--chat-template", task["chat_template"]]
    return argv
