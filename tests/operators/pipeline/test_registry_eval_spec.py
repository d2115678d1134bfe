"""``registry.eval`` in the spec: defaults, and each bad value as a spec error at its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainforge.pipeline import SpecError, parse_spec_text

BASE = (Path(__file__).resolve().parents[2] / "faults" / "fault_tiny.yaml").read_text()


def _spec(block: str, validation: str = ""):
    text = BASE.replace("  aliases: [challenger]\n", "  aliases: [challenger]\n" + block)
    return parse_spec_text(text.replace("validation:\n", "validation:\n" + validation), "p.yaml")


def test_defaults_require_at_least_the_champion_on_exact_match():
    task = _spec("  eval:\n    prompts: eval/prompts.jsonl\n").registry.eval
    assert (task.prompts, task.scoring, task.max_new_tokens, task.require_at_least_champion,
            task.min_score, task.chat_template) == ("eval/prompts.jsonl", "exact_match", 32, True, None, None)
    assert _spec("").registry.eval is None


def test_a_full_block():
    task = _spec("  eval:\n    prompts: p.jsonl\n    scoring: contains\n    max_new_tokens: 8\n"
                 "    require_at_least_champion: false\n    min_score: 0.75\n"
                 "    chat_template: templates/chat.jinja\n").registry.eval
    assert (task.scoring, task.max_new_tokens, task.require_at_least_champion, task.min_score,
            task.chat_template) == ("contains", 8, False, 0.75, "templates/chat.jinja")


@pytest.mark.parametrize(("block", "validation", "where", "fragment"), [
    ("  eval:\n", "", "p.yaml:53:8: registry.eval", "empty (got nothing after 'eval:'"),
    ("  eval: {}\n", "", "registry.eval.prompts", "required"),
    ("  eval:\n    prompts: s3://b/p.jsonl\n", "", "p.yaml:54:14: registry.eval.prompts",
     "is a local file (got 's3://b/p.jsonl'; expected e.g. 'eval/prompts.jsonl'"),
    ("  eval:\n    prompts: ''\n", "", "registry.eval.prompts", "may not be empty"),
    ("  eval:\n    prompts: p.jsonl\n    scoring: fuzzy\n", "", "p.yaml:55:14: registry.eval.scoring",
     "'exact_match' or 'contains'"),
    ("  eval:\n    prompts: p.jsonl\n    max_new_tokens: 0\n", "", "registry.eval.max_new_tokens", ""),
    ("  eval:\n    prompts: p.jsonl\n    min_score: 1.5\n", "", "registry.eval.min_score", "1.5"),
    ("  eval:\n    prompts: p.jsonl\n    min_score: true\n", "", "registry.eval.min_score", ""),
    ("  eval:\n    prompts: p.jsonl\n    require_at_least_champion: 1\n", "",
     "registry.eval.require_at_least_champion", ""),
    ("  eval:\n    prompts: p.jsonl\n    chat_template: https://x/t.jinja\n", "",
     "registry.eval.chat_template", "is a local file (got 'https://x/t.jinja'; expected e.g. 'templates/chat.jinja'"),
    ("  eval:\n    prompt: p.jsonl\n", "", "registry.eval.prompt", "unknown field"),
    ("  eval:\n    prompts: p.jsonl\n", "  gate:\n    enabled: false\n", "p.yaml:55:3: registry.eval",
     "registry.eval adds a task score to the eval gate, but validation.gate.enabled is false"),
])
def test_bad_values_are_spec_errors_at_their_line(block, validation, where, fragment):
    with pytest.raises(SpecError) as err:
        _spec(block, validation)
    assert where in str(err.value) and fragment in str(err.value), str(err.value)
