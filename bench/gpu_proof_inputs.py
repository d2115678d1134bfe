"""The inputs `bench/gpu_proof.py` makes for itself: a dataset of random token ids and an
open-weights folder of a given shape, so that it needs nothing but torch and transformers."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path


def make_dataset(root: Path, vocab_size: int, train_tokens: int, seed: int = 0) -> Path:
    """A trainforge.dataset/v1 folder (docs/contracts.md, "Dataset") of random token ids (uint32
    above 65536 ids) and a word-level tokenizer of ``vocab_size`` entries (the last is the EOS)."""
    import numpy as np
    from tokenizers import Tokenizer, models

    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    root.mkdir(parents=True, exist_ok=True)
    eos = "<|endoftext|>"
    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {eos: vocab_size - 1}
    Tokenizer(models.WordLevel(vocab, unk_token=eos)).save(str(root / "tokenizer.json"))
    rng = np.random.default_rng(seed)
    splits = {}
    for name, n in (("train", train_tokens), ("validation", max(4096, train_tokens // 100))):
        path = root / f"{name}-00000.bin"
        rng.integers(0, vocab_size, size=n, dtype=dtype).tofile(path)
        shard = {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path), "tokens": n}
        # a nominal 4 bytes per id: the trainer divides by it (bits per byte of val/loss_at_start)
        splits[name] = {"documents": 1, "tokens": n, "bytes_utf8": 4 * n, "shards": [shard]}
    tok = root / "tokenizer.json"
    manifest = {"format": "trainforge.dataset/v1", "digest": hashlib.sha256(f"gpu-proof-{vocab_size}-{train_tokens}-"
                                                                           f"{seed}".encode()).hexdigest(),
                "dtype": dtype, "vocab_size": vocab_size, "eos_token": eos, "eos_id": vocab_size - 1,
                "tokenizer": {"file": tok.name, "bytes": tok.stat().st_size, "sha256": _sha256(tok)},
                "splits": splits, "sources": [], "settings": {"generated": "random ids"},
                "stats": {"documents_in": 2, "removed": {"empty": 0, "duplicate": 0}}}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return root


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def pretrained_folder(dest: Path, shape: dict, tokenizer: Path, device: str = "cpu") -> Path:
    """An open-weights folder of ``shape`` (`LLAMA_3_2_1B` or `TINY_PRETRAINED`): random bf16 weights
    in Hugging Face layout, made on ``device``, with the dataset's ``tokenizer`` (the trainer checks
    the dataset was encoded with the folder's)."""
    from pretrained_load import make_checkpoint
    from transformers import LlamaConfig

    v = shape["vocab_size"]
    config = LlamaConfig(
        vocab_size=v, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], head_dim=shape["hidden_size"] // shape["num_heads"],
        max_position_embeddings=shape["max_positions"], rms_norm_eps=1e-5, tie_word_embeddings=shape["tied"],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": shape["original_max_positions"]},
        bos_token_id=v - 2, eos_token_id=v - 1)
    make_checkpoint(dest, config, shards=4, device=device)
    shutil.copyfile(tokenizer, dest / "tokenizer.json")
    return dest
