"""trainforge.trainer.task_eval: greedy answers through the chat template equal plain
transformers ``generate`` on the same rendered prompt, the scoring rules, and bad prompt files."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainforge.trainer.errors import ConfigError
from trainforge.trainer.task_eval import Prompt, answer, is_correct, read_prompts, score_model

PROMPTS = ["Name the play.", "Who speaks first?", "Say something."]


def _load(folder):
    return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(folder))


def _reference(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Plain transformers: the chat template's generation prompt, greedy ``generate`` with the
    model's own generation config, the new tokens before the stop id decoded without special
    tokens (``generate`` keeps the EOS it stopped at)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    new = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)[0, ids.shape[1]:].tolist()
    if new and new[-1] in model.generation_config.eos_token_id:
        new = new[:-1]
    return tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma2"])
def test_answers_equal_transformers_generate(hf_model, family):
    model, tokenizer = _load(hf_model(family))
    for prompt in PROMPTS:
        got = answer(model, tokenizer, prompt, 12)
        assert got == _reference(model, tokenizer, prompt, 12), (family, prompt)
        assert got  # a random model says something, so equality is not two empty strings


def test_generation_stops_at_an_end_of_turn_id(hf_model):
    model, tokenizer = _load(hf_model("llama"))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    free = model.generate(ids, do_sample=False, max_new_tokens=8)[0, ids.shape[1]:].tolist()
    assert len(free) == 8  # the random model never ends its turn by itself
    stop = free[3]  # make the 4th greedy token an end-of-turn id: the answer ends before it
    model.generation_config.eos_token_id = [*model.generation_config.eos_token_id, stop]
    got = answer(model, tokenizer, PROMPTS[0], 8)
    assert got == _reference(model, tokenizer, PROMPTS[0], 8)
    assert got == tokenizer.decode(free[:free.index(stop)], skip_special_tokens=True) != tokenizer.decode(free)


def test_scores_exact_match_and_contains(hf_model):
    model, tokenizer = _load(hf_model("qwen3"))
    said = [_reference(model, tokenizer, p, 6) for p in PROMPTS]
    assert all(len(s.strip()) >= 2 for s in said), said
    prompts = [Prompt(PROMPTS[0], f"  {said[0]}\n"),  # right once stripped
               Prompt(PROMPTS[1], said[1].strip()[1:]),  # a part of the answer: contains only
               Prompt(PROMPTS[2], "not what it says")]
    exact = score_model(model, tokenizer, prompts, "exact_match", 6)
    contains = score_model(model, tokenizer, prompts, "contains", 6)
    assert [r["correct"] for r in exact["results"]] == [True, False, False]
    assert [r["correct"] for r in contains["results"]] == [True, True, False]
    assert (exact["score"], exact["correct"], exact["total"]) == (pytest.approx(1 / 3), 1, 3)
    assert contains["score"] == pytest.approx(2 / 3)
    assert [r["generated"] for r in exact["results"]] == said


def test_a_tokenizer_without_a_chat_template_takes_the_given_one(hf_model):
    model, tokenizer = _load(hf_model("qwen3"))
    template = tokenizer.chat_template
    expected = answer(model, tokenizer, PROMPTS[0], 5)
    tokenizer.chat_template = None
    failed = score_model(model, tokenizer, [Prompt(PROMPTS[0], "x")], "exact_match", 5)
    assert not failed["ok"] and "has no chat template" in failed["error"] and failed["score"] is None
    assert answer(model, tokenizer, PROMPTS[0], 5, chat_template=template) == expected


@pytest.mark.parametrize(("answer_text", "expected", "scoring", "correct"), [
    ("Hamlet", "Hamlet", "exact_match", True), (" Hamlet\n", "Hamlet ", "exact_match", True),
    ("Hamlet, Prince", "Hamlet", "exact_match", False), ("hamlet", "Hamlet", "exact_match", False),
    ("It is Hamlet.", " Hamlet", "contains", True), ("It is Macbeth.", "Hamlet", "contains", False),
])
def test_is_correct(answer_text, expected, scoring, correct):
    assert is_correct(answer_text, expected, scoring) is correct


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"prompt": "a", "expected": "b"}\nnot json\n', "p.jsonl:2: not JSON"),
    ('["a", "b"]\n', "p.jsonl:1: got a JSON list"),
    ('{"prompt": "a"}\n', "p.jsonl:1: field 'expected' is nothing; expected a string"),
    ('\n{"prompt": "", "expected": "b"}\n', "p.jsonl:2: field 'prompt' is ''; expected a non-empty string"),
    ('{"prompt": "a", "expected": 3}\n', "field 'expected' is 3; expected a string"),
    ("\n\n", "no records"),
])
def test_bad_prompt_files_name_the_line_and_field(tmp_path, text, fragment):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match="registry.eval.prompts") as err:
        read_prompts(path)
    assert fragment in str(err.value)


def test_prompt_file_read_in_order(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "expected": str(i), "note": "ignored"})
                              for i, p in enumerate(PROMPTS)) + "\n")
    assert read_prompts(path) == [Prompt(p, str(i)) for i, p in enumerate(PROMPTS)]
    with pytest.raises(ConfigError, match="cannot be read"):
        read_prompts(tmp_path / "missing.jsonl")
