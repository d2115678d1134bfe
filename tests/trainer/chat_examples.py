"""Examples datasets for the trainer tests: generated conversations rendered with a tiny
Hugging Face model folder's real tokenizer and chat template (`trainforge.data.chat`), written
by the data side's own writer (`trainforge.data.examples.write_examples_dataset`)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from tests.hf_models import TEXT
from trainforge.data.chat import ChatRenderer
from trainforge.data.examples import write_examples_dataset

_WORDS = TEXT.split()


def conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    """``n`` conversations of one or two turns whose answers differ in length (a few to ~20 words)."""
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        start = rng.randrange(len(_WORDS) - hi)
        return " ".join(_WORDS[start:start + rng.randint(lo, hi)])

    out = []
    for _ in range(n):
        turns = [{"role": "user", "content": words(3, 10)}, {"role": "assistant", "content": words(1, 20)}]
        if rng.random() < 0.3:
            turns += [{"role": "user", "content": words(2, 5)}, {"role": "assistant", "content": words(1, 6)}]
        out.append(turns)
    return out


def build_examples_dataset(root: Path, model_dir: Path, n_train: int = 48, n_val: int = 8,
                           sequence_length: int = 96, seed: int = 0) -> Path:
    """Render ``n_train + n_val`` conversations with ``model_dir``'s tokenizer and chat template,
    drop those longer than ``sequence_length`` tokens and write an examples dataset into ``root``."""
    renderer = ChatRenderer.from_folder(model_dir)
    tok = renderer.tokenizer
    rendered = [renderer.render(c) for c in conversations(n_train + n_val, seed)]
    kept = [(r.ids, r.mask) for r in rendered if len(r.ids) <= sequence_length]
    train, validation = kept[:-n_val], kept[-n_val:]  # what was dropped comes out of train
    vocab_size = max(tok.get_vocab().values()) + 1
    eos_id = tok.eos_token_id
    digest = hashlib.sha256(f"{model_dir.name}/{n_train}/{n_val}/{sequence_length}/{seed}".encode()).hexdigest()
    write_examples_dataset(
        root, {"train": train, "validation": validation}, tokenizer_file=model_dir / "tokenizer.json",
        vocab_size=vocab_size, eos_token=tok.eos_token, eos_id=eos_id, digest=digest,
        examples={"kind": "chat", "chat_template_sha256": renderer.template_sha256,
                  "sequence_length": sequence_length,
                  "over_length": {"policy": "drop", "dropped": len(rendered) - len(kept), "truncated": 0},
                  "pad_id": tok.pad_token_id if tok.pad_token_id is not None else eos_id})
    return root
