"""The chat example's data, from the demo corpus: name the play a line of dialogue is from.

    python -m trainforge.data.plays_chat --corpus .trainforge/corpus/shakespeare \\
        --dest .trainforge/corpus/shakespeare-plays-chat

Writes ``train.jsonl`` (``{"messages": [user, assistant]}`` records), ``eval.jsonl`` (held-out
lines as ``{"prompt", "expected"}``, the task the eval gate scores) and ``chat_template.jinja``
(the demo's tokenizer has none): five plays, lines of 25 to 70 characters with the name of their
speaker, chosen by hash so the same corpus gives the same files. The pipeline
``dags/examples/shakespeare_plays_chat.yaml`` fine-tunes the demo's model on them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

#: Play file (in the demo corpus) -> the title the model must answer.
PLAYS = {"hamlet_gut.txt": "Hamlet", "macbeth_gut.txt": "Macbeth", "othello_gut.txt": "Othello",
         "romeo_and_juliet_gut.txt": "Romeo and Juliet", "tempest_gut.txt": "The Tempest"}
QUESTION = "Which play is this line from? {line}"
#: Lines per play held out for the eval prompts; the rest (up to TRAIN_PER_PLAY) train.
EVAL_PER_PLAY = 10
TRAIN_PER_PLAY = 300
#: A plain question/answer template that ends each answer with the demo tokenizer's EOS token.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' %}{{ 'QUESTION: ' + message['content'] + '\\n' }}"
    "{%- else %}{{ 'ANSWER: ' + message['content'] + eos_token + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'ANSWER:' }}{%- endif %}"
)
_SPEAKER = re.compile(r"^[A-Z][A-Za-z .'-]{0,30}\.$")  # 'MACBETH.', 'King.', 'Cor. and Volt.'


def spoken_lines(text: str) -> list[str]:
    """Lines of dialogue (25 to 70 characters, inside a speech) as ``"SPEAKER. line"``, in order,
    without duplicates: the speaker's name is the clue a small model can learn the play from."""
    lines, speaker, seen = [], None, set()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            speaker = None
        elif _SPEAKER.match(line):
            speaker = line
        elif speaker and 25 <= len(line) <= 70 and "[" not in line and line not in seen:
            seen.add(line)
            lines.append(f"{speaker} {line}")
    return lines


def build(corpus: Path, dest: Path) -> dict[str, int]:
    """Write the three files into ``dest``; returns how many records each holds."""
    train, prompts = [], []
    for name, title in PLAYS.items():
        lines = sorted(spoken_lines((corpus / name).read_text(encoding="utf-8")),
                       key=lambda line: hashlib.sha256(line.encode()).hexdigest())
        if len(lines) < EVAL_PER_PLAY + 10:
            raise ValueError(f"{corpus / name}: {len(lines)} lines of dialogue, expected at least {EVAL_PER_PLAY + 10}")
        prompts += [{"prompt": QUESTION.format(line=line), "expected": title} for line in lines[:EVAL_PER_PLAY]]
        train += [{"messages": [{"role": "user", "content": QUESTION.format(line=line)},
                                {"role": "assistant", "content": title}]}
                  for line in lines[EVAL_PER_PLAY:EVAL_PER_PLAY + TRAIN_PER_PLAY]]
    train.sort(key=lambda r: hashlib.sha256(r["messages"][0]["content"].encode()).hexdigest())  # plays mixed
    dest.mkdir(parents=True, exist_ok=True)
    for file, records in (("train.jsonl", train), ("eval.jsonl", prompts)):
        tmp = dest / f".{file}.tmp"
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        tmp.replace(dest / file)
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n", encoding="utf-8")
    return {"train": len(train), "eval": len(prompts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainforge.data.plays_chat", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="the demo corpus folder (make corpus)")
    parser.add_argument("--dest", type=Path, required=True, help="where train.jsonl, eval.jsonl and the template go")
    args = parser.parse_args(argv)
    try:
        counts = build(args.corpus, args.dest)
    except (OSError, ValueError) as err:
        print(f"plays_chat: {err}", file=sys.stderr)
        return 1
    print(f"{args.dest}: {counts['train']} training conversations, {counts['eval']} eval prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
