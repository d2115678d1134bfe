"""The chat example's data (trainforge.data.plays_chat) from the real demo corpus: held-out eval
lines never train, every conversation renders with the example's template on a tokenizer like
the demo's (trained BPE, ``<|endoftext|>`` its only special token) with the loss on the title and
the EOS token after it, and the same corpus gives the same bytes."""

from __future__ import annotations

import json

from transformers import PreTrainedTokenizerFast

from trainforge.data.bpe import train_tokenizer
from trainforge.data.chat import ChatRenderer
from trainforge.data.plays_chat import CHAT_TEMPLATE, PLAYS, build


def test_the_plays_chat_data_renders_with_its_template_and_keeps_eval_lines_out(shakespeare_corpus, tmp_path):
    counts = build(shakespeare_corpus, tmp_path / "a")
    train = [json.loads(line) for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (tmp_path / "a" / "eval.jsonl").read_text().splitlines()]
    assert counts == {"train": len(train), "eval": len(prompts)} and len(prompts) == 10 * len(PLAYS)
    assert {p["expected"] for p in prompts} == set(PLAYS.values())
    questions = {r["messages"][0]["content"] for r in train}
    assert len(questions) == len(train) and not questions & {p["prompt"] for p in prompts}
    assert (tmp_path / "a" / "chat_template.jinja").read_text().strip() == CHAT_TEMPLATE

    texts = [r["messages"][0]["content"] for r in train[:200]]
    bpe = train_tokenizer(texts, vocab_size=600, special_tokens=("<|endoftext|>",))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    renderer = ChatRenderer(tokenizer, (tmp_path / "a" / "chat_template.jinja").read_text())
    for record in train:
        title = record["messages"][1]["content"]
        assert renderer.render(record["messages"]).answers == [f" {title}<|endoftext|>"]

    build(shakespeare_corpus, tmp_path / "b")
    for name in ("train.jsonl", "eval.jsonl", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
