"""bench/gpu_proof.py on a machine without a GPU: it says so and exits 0; its arguments are
checked; the figures it derives (FLOP per token, the dataset it makes) are the trainer's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_proof  # noqa: E402


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_proof.py"), *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    proc = _run("--out", str(tmp_path / "page.md"))  # never writes without measuring
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device: nothing measured" in proc.stdout
    assert not (tmp_path / "page.md").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "8"], "--steps=8: expected more than 9"),
    (["--bare-steps", "4"], "--bare-steps=4: expected more than 4"),
    (["--checkpoint-every", "0"], "--checkpoint-every=0: expected 1 to 31"),
    (["--checkpoint-every", "32"], "--checkpoint-every=32: expected 1 to 31"),
    (["--matmul-n", "0"], "--matmul-n=0: expected a positive matrix size"),
    (["--steps", "ten"], "invalid int value: 'ten'"),
])
def test_bad_arguments_are_refused_with_what_was_expected(args, message):
    proc = _run(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_flops_per_token_is_the_trainer_ledger_count_for_the_proof_model():
    from trainforge.trainer.goodput import flops_per_token
    from trainforge.trainer.model import build_model, llama_config

    shape = gpu_proof.TINY
    job = gpu_proof.job_config(shape, Path("/d"), Path("/c"), 10, 5, "bf16")
    from trainforge.trainer.config import parse_job_config

    cfg = parse_job_config(job)
    model = build_model(llama_config(cfg.model, shape["vocab_size"], shape["vocab_size"] - 1, shape["seq_len"]))
    n = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    head_dim = shape["hidden_size"] // shape["num_heads"]
    assert gpu_proof.flops_per_token(shape) == flops_per_token(n - embedding, shape["num_layers"], shape["num_heads"],
                                                               head_dim, shape["seq_len"])


def test_the_generated_dataset_is_one_the_trainer_opens(tmp_path):
    from trainforge.trainer.dataset import read_dataset

    folder = gpu_proof.make_dataset(tmp_path / "d", vocab_size=300, train_tokens=5000)
    dataset = read_dataset(folder)
    assert dataset.vocab_size == 300 and dataset.eos_id == 299 and dataset.splits["train"].tokens == 5000
    assert json.loads((folder / "manifest.json").read_text())["format"] == "trainforge.dataset/v1"


@pytest.mark.heavy
def test_a_cpu_rehearsal_runs_every_part_and_writes_the_page(tmp_path):
    proc = _run("--rehearse-on-cpu", "--steps", "10", "--checkpoint-every", "5", "--bare-steps", "5",
                "--out", str(tmp_path / "page.md"), "--log-dir", str(tmp_path / "logs"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = (tmp_path / "page.md").read_text()
    assert "A CPU rehearsal with a tiny model" in page and "failed" not in page
    figures = json.loads((tmp_path / "logs" / "figures.json").read_text())
    assert figures["errors"] == {} and figures["trainer"]["mid_run_blocked_s"]
    assert "0 after warm-up" in figures["trainer"]["recompile_line"]  # the rehearsal compiles the trainer too
    assert figures["compiled"]["tokens_per_s"] > 0 and figures["eager"]["tokens_per_s"] > 0
