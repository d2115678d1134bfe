"""bench/trainer_overhead.py's open-weights and LoRA cases at a tiny size: the Qwen3-shaped folder it
makes is one the trainer loads from the job config it writes, the bare loop's model is the same weights
(with LoRA: peft's adapters on the same projections, computing what the trainer's compute), and the
bare loop draws the trainer's batches."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_proof  # noqa: E402
import trainer_overhead  # noqa: E402


def _tiny_args(lora: bool) -> argparse.Namespace:
    return argparse.Namespace(hidden_size=64, num_layers=2, num_heads=4, seq_len=32, steps=20, global_batch=8,
                              micro_batch=2, checkpoint_every=10, lora=lora)


def test_the_qwen3_case_trains_the_same_weights_in_ours_and_the_bare_loop(tmp_path):
    from trainforge.trainer.config import parse_job_config
    from trainforge.trainer.dataset import read_dataset
    from trainforge.trainer.model import job_model

    args = _tiny_args(lora=False)
    data = gpu_proof.make_dataset(tmp_path / "d", vocab_size=300, train_tokens=5000)
    folder = trainer_overhead.make_pretrained("qwen3", args, data, tmp_path / "qwen3")
    raw = trainer_overhead.job_config(args, data, tmp_path / "c", folder)
    assert raw["model"] == {"family": "pretrained", "dropout": None} and raw["pretrained"]["folder"] == str(folder)
    cfg = parse_job_config(raw)
    bare = trainer_overhead.bare_model(json.loads(json.dumps(raw)), json.loads((data / "manifest.json").read_text()))
    with job_model(cfg, read_dataset(data), weights=True) as ours:
        assert type(ours).__name__ == type(bare).__name__ == "Qwen3ForCausalLM"
        assert ours.config.num_key_value_heads == 2 and ours.config.tie_word_embeddings
        theirs = bare.state_dict()
        assert all(torch.equal(t, theirs[n]) for n, t in ours.state_dict().items())


def test_the_lora_case_puts_the_same_adapters_on_the_same_weights_in_ours_and_the_bare_loop(tmp_path):
    """Reference: the trainer's model (job config -> job_model -> apply_lora). With equal adapter
    values the bare peft model's logits equal it, so rank, alpha and targets are the same."""
    from trainforge.trainer.adapters import apply_lora
    from trainforge.trainer.config import parse_job_config
    from trainforge.trainer.dataset import read_dataset
    from trainforge.trainer.model import job_model

    args = _tiny_args(lora=True)
    data = gpu_proof.make_dataset(tmp_path / "d", vocab_size=300, train_tokens=5000)
    folder = trainer_overhead.make_pretrained("qwen3", args, data, tmp_path / "qwen3")
    raw = trainer_overhead.job_config(args, data, tmp_path / "c", folder)
    cfg = parse_job_config(raw)
    assert cfg.peft is not None and cfg.peft.target_modules is None  # auto, as a team's spec says it
    bare = trainer_overhead.bare_model(json.loads(json.dumps(raw)), json.loads((data / "manifest.json").read_text()))
    theirs = {n.removeprefix("base_model.model."): p for n, p in bare.named_parameters()}
    with job_model(cfg, read_dataset(data), weights=True) as ours:
        apply_lora(ours, cfg.peft)
        trainable = {n: p for n, p in ours.named_parameters() if p.requires_grad}
        assert len(trainable) == args.num_layers * 7 * 2  # q k v o gate up down, A and B each
        assert {n: p.shape for n, p in theirs.items() if p.requires_grad} == {n: p.shape for n, p in trainable.items()}
        assert all(torch.equal(p, theirs[n]) for n, p in ours.named_parameters() if not p.requires_grad)
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in trainable.items():
                p.normal_(std=0.05)
                theirs[name].copy_(p)
        ours.eval(), bare.eval()  # no dropout
        ids = torch.randint(0, 300, (2, 16))
        with torch.no_grad():
            torch.testing.assert_close(bare(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2])
def test_the_bare_loop_draws_the_trainers_batches(tmp_path, world):
    import numpy as np

    from trainforge.trainer.data import BatchSampler, TokenStream
    from trainforge.trainer.dataset import read_dataset

    args = _tiny_args(lora=True)
    data = gpu_proof.make_dataset(tmp_path / "d", vocab_size=300, train_tokens=5000)
    cfg = trainer_overhead.job_config(args, data, tmp_path / "c")
    accum = args.global_batch // (args.micro_batch * world)
    sampler = BatchSampler(TokenStream(read_dataset(data), "train"), args.seq_len, args.micro_batch, accum, world,
                           cfg["optim"]["seed"])
    tokens = np.fromfile(data / "train-00000.bin", dtype="uint16").astype(np.int64)
    for step in (0, 1, 7):
        for rank in range(world):
            ours = sampler.micro_batches(step, rank)
            bare = trainer_overhead.bare_batches(tokens, cfg, step, rank, world)
            assert len(bare) == len(ours) == accum
            for (x, y), (bx, by) in zip(ours, bare, strict=True):
                assert torch.equal(x, bx) and torch.equal(y, by)


@pytest.mark.heavy
def test_the_lora_case_runs_both_loops_and_reports_the_ratio():
    """The whole bench at a tiny size: two torchrun jobs of 2 processes each (a ratio is printed;
    its value is CPU noise at this size, so only its presence is checked)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trainer_overhead.py"), "--lora", "--steps", "20", "--rounds", "1",
         "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--seq-len", "32", "--global-batch", "8",
         "--micro-batch", "2", "--checkpoint-every", "10", "--no-mlflow"],
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^round 1: ours [\d,]+ tokens/s, bare peft DDP loop [\d,]+ tokens/s", proc.stdout, re.M)
    assert re.search(r"^trainer tokens/s / bare peft DDP loop = \d+\.\d{3} \(goal >= 0\.97: (met|NOT met); "
                     r"open weights, qwen3-shaped .*LoRA r=16 alpha=32", proc.stdout, re.M), proc.stdout
