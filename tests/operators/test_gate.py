"""trainforge.gate: the eval gate's decisions, pure (no MLflow, no Airflow DB)."""

from __future__ import annotations

import pytest

from trainforge.gate import FAIL, PASS, SKIPPED, GateDecision, TaskRules, compare, decide, evaluator_argv


def _evaluation(method: str, candidate: dict, champion: dict, champion_ok: bool = True) -> dict:
    return {"method": method, "models": {
        "candidate": {"ok": True, "metrics": candidate, "error": None},
        "champion": {"ok": champion_ok, "metrics": champion if champion_ok else {},
                     "error": None if champion_ok else "model models:/m/1: cannot be loaded (OSError)"},
    }}


def _decide(**overrides) -> GateDecision:
    args = {"enabled": True, "metric": "val_loss", "min_improvement": 0.0, "candidate_version": "2",
            "candidate_metrics": {"val_loss": 3.0, "val_bits_per_byte": 1.5}, "threshold_failures": [],
            "champion_version": "1", "evaluation": None}
    args.update(overrides)
    return decide(**args)


TOKENS_BETTER = _evaluation("tokens", {"val_loss": 2.9, "val_bits_per_byte": 1.4},
                            {"val_loss": 3.0, "val_bits_per_byte": 1.45})


@pytest.mark.parametrize(("overrides", "decision", "method", "fragment"), [
    ({"enabled": False}, SKIPPED, "none", "validation.gate.enabled is false"),
    ({"champion_version": "2"}, PASS, "none", "v2 is already the champion"),
    ({"threshold_failures": ["val_loss 3.0 above validation.max_val_loss 2.0"]}, FAIL, "thresholds",
     "misses absolute thresholds: val_loss 3.0 above validation.max_val_loss 2.0"),
    ({"champion_version": None}, PASS, "thresholds", "first version of this model"),
    ({"threshold_failures": ["x"], "champion_version": None}, FAIL, "thresholds", "misses absolute"),
    ({"evaluation": TOKENS_BETTER}, PASS, "tokens", "val_loss 2.9000 vs champion 3.0000 (+3.33%"),
    ({"evaluation": TOKENS_BETTER, "min_improvement": 0.05}, FAIL, "tokens", "needs at least 5.00% lower"),
    ({"evaluation": _evaluation("tokens", {"val_loss": 3.0}, {"val_loss": 3.0})}, FAIL, "tokens",
     "+0.00% relative improvement; needs any improvement"),
    ({"evaluation": _evaluation("tokens", {"val_loss": 3.1}, {"val_loss": 3.0})}, FAIL, "tokens", "-3.33%"),
    ({"evaluation": _evaluation("tokens", {"val_loss": None}, {"val_loss": 3.0})}, FAIL, "tokens",
     "candidate val_loss is None"),
    ({"evaluation": _evaluation("tokens", {"val_loss": 2.0}, {}, champion_ok=False)}, FAIL, "tokens",
     "champion v1 could not be evaluated: model models:/m/1: cannot be loaded"),
    ({"evaluation": _evaluation("text", {"val_loss": 9.0, "val_bits_per_byte": 1.2},
                                {"val_loss": 2.0, "val_bits_per_byte": 1.3})}, PASS, "text",
     "(tokenizers differ: compared by val_bits_per_byte, not val_loss)"),
])
def test_decisions(overrides, decision, method, fragment):
    gate = _decide(**overrides)
    assert (gate.decision, gate.method) == (decision, method), gate
    assert fragment in gate.reason
    assert gate.promoted is (decision == PASS)


def test_cross_tokenizer_comparison_uses_bits_per_byte_values():
    gate = _decide(evaluation=_evaluation("text", {"val_bits_per_byte": 1.2}, {"val_bits_per_byte": 1.5}))
    assert (gate.metric, gate.candidate_value, gate.champion_value) == ("val_bits_per_byte", 1.2, 1.5)
    assert gate.improvement == pytest.approx(0.2)


def test_a_champion_without_an_evaluation_is_a_programming_error():
    with pytest.raises(ValueError, match="evaluation report is required"):
        _decide()


@pytest.mark.parametrize(("candidate", "champion", "min_improvement", "ok"), [
    (1.0, 2.0, 0.5, True), (1.01, 2.0, 0.5, False), (float("nan"), 2.0, 0.0, False),
    (1.0, float("inf"), 0.0, False), (1.0, 0.0, 0.0, False), (0.5, 1.0, 0.0, True),
])
def test_compare(candidate, champion, min_improvement, ok):
    assert compare("val_loss", candidate, champion, min_improvement)[0] is ok


def test_tags_round_trip_and_summary():
    gate = _decide(evaluation=TOKENS_BETTER)
    tags = gate.tags(with_champion_after=False)
    assert tags["trainforge.gate.decision"] == "pass" and tags["trainforge.gate.champion_version"] == "1"
    assert "trainforge.gate.champion_after" not in tags
    assert gate.tags()["trainforge.gate.champion_after"] == "none"
    back = GateDecision.from_tags({**tags, "unrelated": "x"})
    assert back is not None and (back.decision, back.reason, back.candidate_value) == (
        gate.decision, gate.reason, gate.candidate_value)
    assert GateDecision.from_tags({"trainforge.gate.decision": "pass"}) is None  # incomplete
    assert gate.summary_line().startswith("eval gate PASSED for v2: val_loss 2.9000")
    assert gate.as_xcom()["promoted"] is True


def test_evaluator_argv():
    argv = evaluator_argv("/py", "/data", {"candidate": "models:/m/2", "champion": "models:/m/1"}, "/r.json", 512)
    assert argv == ["/py", "-m", "trainforge.trainer.evaluate", "--dataset", "/data", "--report", "/r.json",
                    "--max-eval-tokens", "512", "--model", "candidate=models:/m/2", "--model",
                    "champion=models:/m/1"]


# -- registry.eval: the task score ------------------------------------------------------------

def _task(correct: int, total: int = 5) -> dict:
    return {"ok": True, "score": correct / total, "correct": correct, "total": total, "results": [],
            "error": None}


def _scored(candidate_loss: float, champion_loss: float, candidate: dict, champion: dict | None) -> dict:
    evaluation = _evaluation("tokens", {"val_loss": candidate_loss}, {"val_loss": champion_loss})
    evaluation["models"]["candidate"]["task"] = candidate
    if champion is None:
        del evaluation["models"]["champion"]
    else:
        evaluation["models"]["champion"]["task"] = champion
    return evaluation


NOT_SCORED = {"ok": False, "score": None, "correct": None, "total": 5, "results": [],
              "error": "task scoring failed at prompt 1: ConfigError: the tokenizer has no chat template"}
RULES = TaskRules()


@pytest.mark.parametrize(("evaluation", "overrides", "decision", "fragment"), [
    # equal loss, lower task score: refused for the task score, before the loss is compared
    (_scored(3.0, 3.0, _task(2), _task(3)), {}, FAIL,
     "task score 0.40 (2/5) is below the champion's 0.60 (3/5) (registry.eval.require_at_least_champion)"),
    # a lower loss does not buy back a lower task score
    (_scored(2.0, 3.0, _task(2), _task(3)), {}, FAIL, "is below the champion's 0.60"),
    # a tie on the task: the validation loss decides, and the reason says so
    (_scored(2.9, 3.0, _task(3), _task(3)), {}, PASS,
     "task score 0.60 (3/5) equals the champion's 0.60 (3/5); the validation loss decided: val_loss 2.9000"),
    (_scored(3.0, 3.0, _task(3), _task(3)), {}, FAIL,
     "the validation loss decided: val_loss 3.0000 vs champion 3.0000 (+0.00% relative improvement"),
    (_scored(2.9, 3.0, _task(4), _task(3)), {}, PASS, "task score 0.80 (4/5) vs the champion's 0.60 (3/5); val_loss"),
    (_scored(3.1, 3.0, _task(4), _task(3)), {}, FAIL, "vs the champion's 0.60 (3/5); val_loss 3.1000"),
    # below the threshold, whatever the champion scores
    (_scored(2.0, 3.0, _task(2), _task(1)), {"task": TaskRules(min_score=0.5)}, FAIL,
     "task score 0.40 (2/5) is below registry.eval.min_score 0.50"),
    # without require_at_least_champion a lower score is only reported
    (_scored(2.9, 3.0, _task(2), _task(3)), {"task": TaskRules(require_at_least_champion=False)}, PASS,
     "task score 0.40 (2/5) vs the champion's 0.60 (3/5); val_loss 2.9000"),
    (_scored(2.9, 3.0, _task(2), NOT_SCORED), {"task": TaskRules(require_at_least_champion=False)}, PASS,
     "task score 0.40 (2/5) vs the champion's not measured; val_loss 2.9000"),
    (_scored(2.9, 3.0, _task(4), NOT_SCORED), {}, FAIL,
     "champion v1's task score could not be measured: task scoring failed at prompt 1: ConfigError: the "
     "tokenizer has no chat template; fix or move the champion alias by hand"),
    (_scored(2.9, 3.0, NOT_SCORED, _task(3)), {}, FAIL,
     "the candidate's task score could not be measured: task scoring failed at prompt 1"),
    # the first version: scored alone, against the threshold only
    (_scored(3.0, 3.0, _task(3), None), {"champion_version": None}, PASS,
     "first version of this model and it meets every absolute threshold; task score 0.60 (3/5)"),
    (_scored(3.0, 3.0, _task(1), None), {"champion_version": None, "task": TaskRules(min_score=0.5)}, FAIL,
     "task score 0.20 (1/5) is below registry.eval.min_score 0.50"),
])
def test_task_score_decisions(evaluation, overrides, decision, fragment):
    gate = _decide(**{"evaluation": evaluation, "task": RULES, **overrides})
    assert gate.decision == decision, gate
    assert fragment in gate.reason, gate.reason


def test_task_scores_are_recorded_and_round_trip_through_tags():
    gate = _decide(evaluation=_scored(2.9, 3.0, _task(3), _task(3)), task=RULES)
    assert (gate.task_score, gate.champion_task_score) == (pytest.approx(0.6), pytest.approx(0.6))
    back = GateDecision.from_tags(gate.tags())
    assert (back.task_score, back.champion_task_score) == (pytest.approx(0.6), pytest.approx(0.6))
    assert _decide(evaluation=TOKENS_BETTER).tags()["trainforge.gate.task_score"] == "none"


def test_task_rules_without_an_evaluation_are_a_programming_error():
    with pytest.raises(ValueError, match="evaluation report is required"):
        _decide(champion_version=None, task=RULES)


def test_evaluator_argv_with_task_prompts():
    argv = evaluator_argv("/py", "/data", {"candidate": "models:/m/2"}, "/r.json", 512,
                          {"prompts": "/p.jsonl", "scoring": "contains", "max_new_tokens": 16,
                           "chat_template": "/t.jinja"})
    assert argv[-9:] == ["candidate=models:/m/2", "--prompts", "/p.jsonl", "--scoring", "contains",
                         "--max-new-tokens", "16", "--chat-template", "/t.jinja"]
    assert "--chat-template" not in evaluator_argv("/py", "/d", {}, "/r", 1, {
        "prompts": "/p", "scoring": "exact_match", "max_new_tokens": 1, "chat_template": None})
