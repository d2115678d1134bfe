"""bench/gpu_proof.py on a machine without a GPU: it says so and exits 0; its arguments are
checked; the figures it derives (FLOP per token, the dataset it makes) are the trainer's; the
open-weights folder of ``--pretrained`` (at a tiny size) is one the trainer loads, and with
``--lora`` the bare loops' peft model computes what the trainer's LoRA model computes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_proof  # noqa: E402


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_proof.py"), *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("model", [[], ["--pretrained"], ["--lora"]], ids=["llama", "pretrained", "lora"])
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, model):
    proc = _run(*model, "--out", str(tmp_path / "page.md"))  # never writes without measuring
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


@pytest.mark.parametrize(("vocab", "dtype"), [(300, "uint16"), (70000, "uint32")])
def test_the_generated_dataset_is_one_the_trainer_opens(tmp_path, vocab, dtype):
    from trainforge.trainer.dataset import read_dataset

    folder = gpu_proof.make_dataset(tmp_path / "d", vocab_size=vocab, train_tokens=5000)
    dataset = read_dataset(folder)
    assert dataset.vocab_size == vocab and dataset.eos_id == vocab - 1 and dataset.splits["train"].tokens == 5000
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "trainforge.dataset/v1" and manifest["dtype"] == dtype


def test_the_pretrained_folder_loads_in_the_trainer_with_llama_3_2s_features(tmp_path):
    """The tiny stand-in of the Llama-3.2-1B folder: the trainer's job_model loads it from the job
    config (rope llama3, tied embeddings, GQA kept), and the FLOP count is the trainer's."""
    from trainforge.trainer.config import parse_job_config
    from trainforge.trainer.dataset import read_dataset
    from trainforge.trainer.goodput import flops_per_token
    from trainforge.trainer.model import attention_shape, job_model

    shape = gpu_proof.TINY_PRETRAINED
    data = gpu_proof.make_dataset(tmp_path / "d", vocab_size=shape["vocab_size"], train_tokens=5000)
    folder = gpu_proof.pretrained_folder(tmp_path / "model", shape, data / "tokenizer.json")
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(folder.glob("model-*.safetensors"))) >= 3
    cfg = parse_job_config(gpu_proof.job_config(shape, data, tmp_path / "c", 10, 5, "bf16", folder=folder))
    with job_model(cfg, read_dataset(data), weights=True) as model:
        c = model.config
        assert c.rope_parameters["rope_type"] == "llama3" and c.tie_word_embeddings
        assert c.num_key_value_heads == shape["num_kv_heads"] and c.num_hidden_layers == shape["num_layers"]
        assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        n = sum(p.numel() for p in model.parameters())
        embedding = model.get_input_embeddings().weight.numel()
        assert gpu_proof.flops_per_token(shape) == flops_per_token(n - embedding, *attention_shape(c), shape["seq_len"])


def test_the_lora_case_counts_the_trainers_flops_and_its_bare_loops_compute_the_trainers_model(tmp_path):
    """Reference: the trainer's LoRA model (job config -> job_model -> apply_lora) and its ledger's
    FLOP count; with equal adapter values the bare loops' peft model gives the same logits."""
    from trainforge.trainer.adapters import apply_lora
    from trainforge.trainer.config import parse_job_config
    from trainforge.trainer.dataset import read_dataset
    from trainforge.trainer.goodput import flops_per_token
    from trainforge.trainer.model import attention_shape, job_model

    shape = gpu_proof.TINY_PRETRAINED
    data = gpu_proof.make_dataset(tmp_path / "d", vocab_size=shape["vocab_size"], train_tokens=5000)
    folder = gpu_proof.pretrained_folder(tmp_path / "model", shape, data / "tokenizer.json")
    raw = gpu_proof.job_config(shape, data, tmp_path / "c", 10, 5, "bf16", folder=folder, lora=gpu_proof.LORA)
    cfg = parse_job_config(raw)
    assert cfg.peft is not None and cfg.peft.r == gpu_proof.LORA["r"] and cfg.peft.target_modules is None
    bare = gpu_proof.bare_model(json.loads(json.dumps(raw)), json.loads((data / "manifest.json").read_text()), "cpu")
    theirs = {n.removeprefix("base_model.model."): p for n, p in bare.named_parameters()}
    with job_model(cfg, read_dataset(data), weights=True) as model:
        n = sum(p.numel() for p in model.parameters())
        apply_lora(model, cfg.peft)
        adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
        embedding = model.get_input_embeddings().weight.numel()
        count = sum(p.numel() for p in adapters.values())
        assert gpu_proof.flops_per_token(shape, gpu_proof.LORA) == flops_per_token(
            n + count - embedding, *attention_shape(model.config), shape["seq_len"], trainable_non_embedding=count)
        assert {k: p.shape for k, p in theirs.items() if p.requires_grad} == {k: p.shape for k, p in adapters.items()}
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in adapters.items():
                p.normal_(std=0.05)
                theirs[name].copy_(p)
        model.eval(), bare.eval()  # no dropout
        ids = torch.randint(0, shape["vocab_size"], (2, 16))
        with torch.no_grad():
            torch.testing.assert_close(bare(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
@pytest.mark.parametrize("model", [[], ["--pretrained"], ["--lora"]], ids=["llama", "pretrained", "lora"])
def test_a_cpu_rehearsal_runs_every_part_and_writes_the_page(tmp_path, model):
    proc = _run(*model, "--rehearse-on-cpu", "--steps", "10", "--checkpoint-every", "5", "--bare-steps", "5",
                "--out", str(tmp_path / "page.md"), "--log-dir", str(tmp_path / "logs"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = (tmp_path / "page.md").read_text()
    assert "A CPU rehearsal with a tiny model" in page and "failed" not in page
    figures = json.loads((tmp_path / "logs" / "figures.json").read_text())
    assert figures["errors"] == {} and figures["trainer"]["mid_run_blocked_s"]
    assert "0 after warm-up" in figures["trainer"]["recompile_line"]  # the rehearsal compiles the trainer too
    assert figures["compiled"]["tokens_per_s"] > 0 and figures["eager"]["tokens_per_s"] > 0
    if model == ["--lora"]:
        assert "(open weights, LoRA)" in page and "LoRA fine-tuning: adapters of rank 16" in page
        assert "the adapters and AdamW state" in page
