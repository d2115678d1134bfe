"""The task score of the eval gate: prompts answered by greedy generation, scored against answers.

Each prompt is one user turn rendered by the chat template with the generation prompt, answered
greedily by ``model.generate`` until an end-of-turn or EOS id (the model's generation config and
its tokenizer's EOS) or ``max_new_tokens``; the answer is the new tokens decoded without special
tokens. ``exact_match``: answer and expected equal once stripped of surrounding whitespace;
``contains``: the answer contains the stripped expected text. The score is the fraction correct.
``python -m trainforge.trainer.evaluate --prompts FILE`` scores every model it evaluates this way
(docs/registry.md, "The eval gate"). Nothing here compares models: the gate does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainforge.trainer.errors import ConfigError

SCORINGS = ("exact_match", "contains")
#: Per-prompt results kept in the evaluation report (and so in the MLflow table) at most.
MAX_RESULTS = 1000


@dataclass(frozen=True)
class Prompt:
    prompt: str
    expected: str


def read_prompts(path: str | Path) -> list[Prompt]:
    """The ``{"prompt": ..., "expected": ...}`` records of a JSONL file, in order.

    Blank lines are skipped; other keys are ignored.

    Raises:
        ConfigError: the file cannot be read, a line is not a JSON object, ``prompt`` or
            ``expected`` is missing or not a string (``prompt`` also empty), or there is no record;
            the message names the file, the line and the field.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"registry.eval.prompts {str(path)!r} cannot be read: {err}; expected a "
                          'UTF-8 JSONL file of {"prompt": ..., "expected": ...} records') from err
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"registry.eval.prompts {path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"{where}: not JSON ({err}); expected one object per line") from err
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: got a JSON {type(record).__name__}; expected an object with "
                              '"prompt" and "expected"')
        for field in ("prompt", "expected"):
            value = record.get(field)
            if not isinstance(value, str) or (field == "prompt" and not value.strip()):
                got = "nothing" if field not in record else repr(value)[:80]
                raise ConfigError(f"{where}: field {field!r} is {got}; expected a "
                                  f"{'non-empty ' if field == 'prompt' else ''}string")
        prompts.append(Prompt(record["prompt"], record["expected"]))
    if not prompts:
        raise ConfigError(f"registry.eval.prompts {path}: no records; expected at least one "
                          '{"prompt": ..., "expected": ...} line')
    return prompts


def is_correct(answer: str, expected: str, scoring: str) -> bool:
    """Whether ``answer`` scores as ``expected`` under ``scoring`` (module doc)."""
    if scoring == "exact_match":
        return answer.strip() == expected.strip()
    if scoring == "contains":
        return expected.strip() in answer
    raise ConfigError(f"scoring {scoring!r} is not one of {', '.join(SCORINGS)}")


def stop_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """The ids generation stops at: the generation config's EOS ids (end-of-turn tokens among
    them) and the tokenizer's EOS, in that order, without repeats."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))


@torch.no_grad()
def answer(model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int,
           chat_template: str | None = None, device: str = "cpu") -> str:
    """The greedy answer to ``prompt`` as one user turn (module doc), decoded text.

    Raises:
        ConfigError: the tokenizer has no chat template and none is given.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("the tokenizer has no chat template; give one with registry.eval.chat_template "
                          "or data.chat_template")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], chat_template=template,
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = ids["input_ids"].to(device)  # (1, prompt_len) int64
    stops = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or [0])[0]
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=stops or None, pad_token_id=pad,
                         temperature=None, top_p=None, top_k=None)  # (1, prompt_len + new) int64
    new = out[0, input_ids.shape[1]:].tolist()
    for i, token in enumerate(new):
        if token in stops:
            new = new[:i]
            break
    return tokenizer.decode(new, skip_special_tokens=True)


def score_model(model: torch.nn.Module, tokenizer: Any, prompts: list[Prompt], scoring: str,
                max_new_tokens: int, chat_template: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """One model's task entry of the evaluation report: ``{"ok", "score", "correct", "total",
    "results": [{"prompt", "expected", "generated", "correct"}], "error"}``; a failure (no chat
    template, generation raising) is ``ok: false`` with its ``error``, never an exception."""
    results = []
    try:
        for p in prompts:
            generated = answer(model, tokenizer, p.prompt, max_new_tokens, chat_template, device)
            results.append({"prompt": p.prompt, "expected": p.expected, "generated": generated,
                            "correct": is_correct(generated, p.expected, scoring)})
    except (ConfigError, RuntimeError, ValueError, TypeError) as err:  # jinja's errors are ValueErrors
        return {"ok": False, "score": None, "correct": None, "total": len(prompts), "results": results,
                "error": f"task scoring failed at prompt {len(results) + 1}: {type(err).__name__}: {err}"}
    correct = sum(r["correct"] for r in results)
    return {"ok": True, "score": correct / len(results), "correct": correct, "total": len(results),
            "results": results[:MAX_RESULTS], "error": None}


@dataclass(frozen=True)
class TaskEval:
    """What ``evaluate --prompts`` scores every model with (module doc)."""

    prompts: list[Prompt]
    scoring: str = "exact_match"
    max_new_tokens: int = 32
    chat_template: str | None = None  # the template's text; None: each model's own

    @classmethod
    def from_files(cls, prompts: str, scoring: str, max_new_tokens: int,
                   chat_template: str | None = None) -> TaskEval:
        """Read the prompts file and the template file.

        Raises:
            ConfigError: a file cannot be read, a record is malformed, a bad scoring or count.
        """
        if scoring not in SCORINGS:
            raise ConfigError(f"--scoring {scoring!r}: expected one of {', '.join(SCORINGS)}")
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {max_new_tokens}: expected at least 1")
        template = None
        if chat_template:
            try:
                template = Path(chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise ConfigError(f"chat template {chat_template!r} cannot be read: {err}; expected a "
                                  "UTF-8 Jinja file") from err
        return cls(read_prompts(prompts), scoring, max_new_tokens, template)

    def score(self, model: torch.nn.Module, tokenizer: Any, device: str = "cpu") -> dict[str, Any]:
        return score_model(model, tokenizer, self.prompts, self.scoring, self.max_new_tokens,
                           self.chat_template, device)


def add_arguments(parser: Any) -> None:
    """``evaluate``'s task options (argparse)."""
    parser.add_argument("--prompts", help="JSONL of {prompt, expected}: also score each model on them")
    parser.add_argument("--scoring", default="exact_match", choices=SCORINGS)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--chat-template", help="Jinja file rendering every model's prompts "
                        "(default: each model's own template)")


def from_args(args: Any) -> TaskEval | None:
    """The `TaskEval` that `add_arguments`' options ask for, None without ``--prompts``.

    Raises:
        ConfigError: as `TaskEval.from_files`.
    """
    if not args.prompts:
        return None
    return TaskEval.from_files(args.prompts, args.scoring, args.max_new_tokens, args.chat_template)


def summary(entry: dict[str, Any]) -> str:
    """``0.60 (3/5 correct)`` or the entry's error: one model's task score for a log line."""
    if not entry.get("ok"):
        return f"not measured: {entry.get('error')}"
    return f"{entry['score']:.2f} ({entry['correct']}/{entry['total']} correct)"
