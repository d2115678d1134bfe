"""The chunked training loss (trainforge.trainer.loss) against the plain one.

Same loss and the same gradient on every parameter, in fp32 and under bf16 and fp16 autocast,
tied and untied embeddings, on a bare model, with compiled decoder layers, and under DDP and
FSDP2 with 2 gloo ranks (this file is then the torchrun worker: ``python -m torch.distributed.run
--nproc-per-node=2 tests/trainer/test_loss.py RESULT.json``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trainforge.trainer import loss
from trainforge.trainer.model import lm_loss

VOCAB, BATCH, SEQ = 320, 2, 40
CHUNK = 24  # 80 tokens: chunks of 24, 24, 24 and 8; backward: vocabulary slices of 96
#: fp32: the largest |chunked - plain| gradient element over the parameter's largest |plain| one.
FP32_GRAD_TOLERANCE = 1e-5
#: Under autocast both paths round (differently) to bf16 or fp16: the chunked gradients must be
#: as close to the fp32 ones as the plain gradients are, within this factor.
AUTOCAST_ERROR_RATIO = 1.5
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_LOSS_SCALE = 2.0**12  # what a GradScaler multiplies by


def tiny_model(tied: bool, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y: (BATCH, SEQ) int64; a few targets are IGNORE_INDEX."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y[0, :3] = loss.IGNORE_INDEX
    return x, y


def loss_and_grads(model, x, y, fn, precision: str = "fp32", scale: float = 1.0):
    """(loss, {name: full gradient}) of one forward and backward of ``fn(model, x, y)``."""
    model.zero_grad(set_to_none=True)
    dtype = AUTOCAST[precision]
    with torch.autocast(x.device.type, dtype=dtype) if dtype else contextlib.nullcontext():
        value = fn(model, x, y)
    (value * scale).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP2: DTensor shards
        grads[name] = grad.detach().clone() / scale
    return value.detach(), grads


def chunked(model, x, y):
    return loss.lm_loss(model, x, y, chunk_tokens=CHUNK)


def worst_grad_error(expected: dict, got: dict) -> tuple[float, str]:
    """(largest |got - expected| over the parameter's largest |expected|, that parameter)."""
    assert expected.keys() == got.keys()
    return max((((got[n] - expected[n]).abs().max() / expected[n].abs().max()).item(), n) for n in expected)


def compare(module, x, y, precision: str, chunked_loss=None) -> dict:
    """Plain and chunked loss and gradients of ``module`` at ``precision``, against fp32 too."""
    chunked_loss = chunked_loss or chunked
    scale = FP16_LOSS_SCALE if precision == "fp16" else 1.0
    plain_loss, plain_grads = loss_and_grads(module, x, y, loss.plain_lm_loss, precision, scale)
    chunk_loss, chunk_grads = loss_and_grads(module, x, y, chunked_loss, precision, scale)
    row = {"loss": plain_loss.item(), "chunked_loss": chunk_loss.item(), "dtype": str(chunk_loss.dtype),
           "vs_plain": worst_grad_error(plain_grads, chunk_grads)}
    if precision != "fp32":
        _, fp32_grads = loss_and_grads(module, x, y, loss.plain_lm_loss, "fp32")
        row["plain_vs_fp32"] = worst_grad_error(fp32_grads, plain_grads)
        row["chunked_vs_fp32"] = worst_grad_error(fp32_grads, chunk_grads)
    return row


def assert_as_exact_as_plain(row: dict, precision: str, loss_rel: float = 1e-6) -> None:
    assert row["dtype"] == "torch.float32"
    assert row["chunked_loss"] == pytest.approx(row["loss"], rel=loss_rel)
    if precision == "fp32":
        assert row["vs_plain"][0] <= FP32_GRAD_TOLERANCE, row
    else:
        assert row["chunked_vs_fp32"][0] <= AUTOCAST_ERROR_RATIO * row["plain_vs_fp32"][0], row


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_chunked_loss_and_every_gradient_equal_the_plain_path(precision, tied):
    model, (x, y) = tiny_model(tied), batch()
    assert_as_exact_as_plain(compare(model, x, y, precision), precision)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 79, 80, 200])
def test_linear_cross_entropy_equals_f_cross_entropy(chunk_tokens):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(80, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (80,), generator=g)
    targets[::9] = loss.IGNORE_INDEX
    expected = F.cross_entropy(F.linear(hidden, weight), targets)
    expected_grads = torch.autograd.grad(expected * 3, (hidden, weight))
    got = loss.linear_cross_entropy(hidden, weight, targets, chunk_tokens)
    got_grads = torch.autograd.grad(got * 3, (hidden, weight))
    torch.testing.assert_close(got, expected)
    for e, g_ in zip(expected_grads, got_grads):
        torch.testing.assert_close(g_, e)


def _saved_tensor_shapes(fn) -> list[torch.Size]:
    """Shapes of the tensors autograd keeps for the backward of ``fn``, parameters (and views of them) left out."""
    model, (x, y) = tiny_model(tied=True), batch()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in parameters:
            shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(model, x, y)
    return shapes


def test_no_logits_are_kept_for_backward():
    logits_like = [s for s in _saved_tensor_shapes(chunked) if len(s) and s[-1] == VOCAB and s.numel() > 0]
    assert logits_like == []
    plain = [s for s in _saved_tensor_shapes(loss.plain_lm_loss) if len(s) and s[-1] == VOCAB]
    assert torch.Size([BATCH * SEQ, VOCAB]) in plain  # what the chunked path avoids


def _lm_head_output_shapes(fn) -> list[tuple[int, ...]]:
    model, (x, y) = tiny_model(tied=False), batch()
    shapes = []
    model.lm_head.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    fn(model, x, y)
    return shapes


@pytest.mark.parametrize(("fn", "lm_head_out"), [
    (lm_loss, (BATCH, SEQ, VOCAB)),  # the default chunk (chunk_tokens_for(320)) holds all 80 tokens
    (lambda m, x, y: loss.lm_loss(m, x, y, chunk_tokens=0), (BATCH, SEQ, VOCAB)),  # chunking off
    (lambda m, x, y: loss.lm_loss(m, x, y, chunk_tokens=BATCH * SEQ), (BATCH, SEQ, VOCAB)),
    (lambda m, x, y: loss.lm_loss(m, x, y, chunk_tokens=BATCH * SEQ - 1), (BATCH, 0, VOCAB)),
], ids=["default", "off", "one-chunk", "two-chunks"])
def test_plain_path_when_the_logits_fit_one_chunk(fn, lm_head_out):
    assert _lm_head_output_shapes(fn) == [lm_head_out]


@pytest.mark.parametrize(("vocab", "mib", "tokens"), [
    (32000, 256, 2048), (128256, 256, 512), (320, 256, 209664), (10**9, 256, 64), (32000, 0, 0),
])
def test_chunk_tokens_for(vocab, mib, tokens):
    assert loss.chunk_tokens_for(vocab, mib) == tokens


def test_model_lm_loss_is_the_chunked_loss_with_its_defaults(monkeypatch):
    monkeypatch.setattr(loss, "CHUNK_LOGITS_MIB", 0)
    assert loss.chunk_tokens_for(VOCAB, loss.CHUNK_LOGITS_MIB) == 0
    model, (x, y) = tiny_model(tied=True), batch()
    assert torch.equal(lm_loss(model, x, y), loss.plain_lm_loss(model, x, y))


def test_compiled_decoder_layers():
    """Layers compiled one by one (aot_eager: dynamo and AOTAutograd, no codegen, seconds)."""
    model, (x, y) = tiny_model(tied=True), batch()
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    for _ in range(2):  # the second time runs the cached graphs
        assert_as_exact_as_plain(compare(model, x, y, "fp32"), "fp32")


@pytest.mark.gpu
def test_on_cuda_the_default_chunks_hold_less_memory_for_the_same_result():
    """bf16 autocast, vocabulary 32000, 4 x 1024 tokens: two chunks of 2048 at the defaults."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (install a CUDA build of torch and the NVIDIA driver)")
    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda()
    x, y = (torch.randint(0, 32000, (4, 1024), device="cuda") for _ in range(2))
    assert loss.chunk_tokens_for(32000) == 2048

    def peak_bytes(fn) -> int:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = fn(model, x, y)
        value.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    assert_as_exact_as_plain(compare(model, x, y, "bf16", chunked_loss=lm_loss), "bf16", loss_rel=1e-3)
    plain_peak, chunk_peak = peak_bytes(loss.plain_lm_loss), peak_bytes(lm_loss)
    assert chunk_peak < 0.6 * plain_peak, (chunk_peak, plain_peak)


# --- 2 gloo ranks: DDP and FSDP2 ------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]
#: (name, parallelism, tied, activation checkpointing, precision)
DISTRIBUTED_CASES = [("ddp-tied", "ddp", True, False, "fp32"), ("ddp-untied", "ddp", False, False, "fp32"),
                     ("fsdp-tied", "fsdp", True, True, "fp32"), ("fsdp-untied", "fsdp", False, False, "fp32"),
                     ("fsdp-bf16", "fsdp", True, False, "bf16")]


@pytest.mark.distributed
def test_ddp_and_fsdp2_losses_and_gradients_equal_the_plain_path(tmp_path):
    result = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           __file__, str(result)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = json.loads(result.read_text())
    for name, _, _, _, precision in DISTRIBUTED_CASES:
        assert_as_exact_as_plain(rows[name], precision)
        assert rows[name]["ranks_differ"], name  # each rank had its own batch: the gradients were reduced
    assert "reshard_after_forward=True" in rows["fsdp-root-resharded"]["error"]


def _distributed_worker(result_path: str) -> None:
    """One rank: each case's plain and chunked loss and gradients, twice (the second iteration
    checks that DDP and FSDP2 saw every gradient in the first); rank 0 writes the rows."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainforge.trainer.model import enable_activation_checkpointing

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = {}
    for name, parallelism, tied, checkpointing, precision in DISTRIBUTED_CASES:
        model = tiny_model(tied)
        if checkpointing:
            enable_activation_checkpointing(model)
        if parallelism == "fsdp":
            for layer in model.model.layers:
                fully_shard(layer)
            module = fully_shard(model)
        else:
            module = DDP(model)
        x, y = batch(seed=10 + rank)
        for _ in range(2):
            row = compare(module, x, y, precision)
        gathered = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(gathered, torch.tensor([row["loss"]]))
        rows[name] = row | {"ranks_differ": bool(gathered[0] != gathered[1])}
    model = tiny_model(tied=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=True)
    try:
        chunked(model, *batch(seed=10 + rank))
        rows["fsdp-root-resharded"] = {"error": ""}
    except RuntimeError as err:
        rows["fsdp-root-resharded"] = {"error": str(err)}
    if rank == 0:
        Path(result_path).write_text(json.dumps(rows, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    _distributed_worker(sys.argv[1])
