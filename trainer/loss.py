"""The training loss, mean next-token cross-entropy, without holding every token's logits at once.

`lm_loss` runs the model's root forward with no logits (``logits_to_keep``: an empty index), takes
the final normed hidden states from a forward hook on the decoder stack, and applies
`linear_cross_entropy`: the lm_head matmul and an fp32 log-softmax one chunk of tokens at a time,
in the forward and again in the backward. Torch and transformers only. Never call the decoder
(``model.model``) directly: under FSDP2 that bypasses the root's hooks. Why recompute, not
precompute, gradients: `_LinearCrossEntropy`; memory and time: bench/loss_memory.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

#: MiB of fp32 logits per chunk: sets the chunk to ``CHUNK_LOGITS_MIB * 2**18 // vocab`` tokens
#: (rounded down to a multiple of 64), e.g. 2048 tokens at a 32k vocabulary, 512 at 128k. A
#: micro-batch whose logits fit in one chunk takes the plain path (chunking it would only add the
#: backward's recomputation); ``0`` sends every micro-batch down the plain path.
CHUNK_LOGITS_MIB = 256
#: Targets with this value add no loss and are left out of the mean (F.cross_entropy's default).
IGNORE_INDEX = -100


def chunk_tokens_for(vocab_size: int, logits_mib: int = CHUNK_LOGITS_MIB) -> int:
    """Tokens per chunk for ``vocab_size`` (see `CHUNK_LOGITS_MIB`); 0 when ``logits_mib`` is 0."""
    if logits_mib <= 0:
        return 0
    return max(64, logits_mib * 2**18 // vocab_size // 64 * 64)  # 2**18 fp32 values per MiB


def plain_lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`lm_loss` the direct way: all ``(b, T, vocab)`` logits, then ``F.cross_entropy`` in fp32."""
    logits = model(input_ids=x, use_cache=False).logits  # (b, T, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
            chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in nats per token (targets `IGNORE_INDEX` left out).

    Args:
        model: a `LlamaForCausalLM`, bare, under FSDP2 (``fully_shard`` on the root), or wrapped
            in DDP; its decoder layers may be compiled one by one, its root not.
        x: (b, T) int64 input ids.
        y: (b, T) int64 targets (x shifted left by one).
        chunk_tokens: tokens per chunk; None: `chunk_tokens_for` the vocabulary. When ``b * T``
            is at most this (or it is 0), the plain path (`plain_lm_loss`).
    Returns:
        scalar float32 tensor (computed in fp32 even under bf16 autocast).
    Raises:
        RuntimeError: the lm_head weight is still sharded after the root forward (an FSDP2
            root with ``reshard_after_forward=True``; the default keeps it whole until backward).
    """
    causal_lm = _unwrap(model)
    head = causal_lm.get_output_embeddings()
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(head.weight.shape[0])
    if chunk_tokens <= 0 or y.numel() <= chunk_tokens or head.bias is not None:
        return plain_lm_loss(model, x, y)

    captured: list[torch.Tensor] = []

    def keep_hidden(module: torch.nn.Module, args: Any, output: Any) -> None:
        captured.append(output[0])  # last_hidden_state, after the final norm: (b, T, hidden)

    hook = causal_lm.get_decoder().register_forward_hook(keep_hidden)
    try:
        # The root forward (FSDP2 unshards the embedding, final norm and lm_head for it) with an
        # empty logits_to_keep: lm_head sees (b, 0, hidden) and computes no logits.
        model(input_ids=x, use_cache=False, logits_to_keep=torch.empty(0, dtype=torch.long, device=x.device))
    finally:
        hook.remove()
    weight = head.weight  # (vocab, hidden); FSDP2: the root's unsharded parameter until its post-backward
    if isinstance(weight, DTensor):
        raise RuntimeError("lm_loss: the lm_head weight is sharded after the root forward (FSDP2 root with "
                           "reshard_after_forward=True?); fully_shard the root with the default, or set "
                           "trainforge.trainer.loss.CHUNK_LOGITS_MIB = 0 for the plain loss")
    return linear_cross_entropy(captured[0].flatten(0, 1), weight, y.flatten(), chunk_tokens)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_tokens: int) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), targets)``, ``chunk_tokens`` rows at a time.

    Args:
        hidden: (N, hidden) final hidden states.
        weight: (vocab, hidden) lm_head weight.
        targets: (N,) int64 token ids, or `IGNORE_INDEX`.
        chunk_tokens: rows per chunk; memory holds one chunk's (chunk_tokens, vocab) logits.
    Returns:
        scalar float32 mean over the targets that are not `IGNORE_INDEX` (nan if none).

    The matmuls run in the autocast dtype when autocast is on (as ``F.linear`` would), else in
    ``hidden``'s dtype; softmax and loss in fp32. Gradients reach ``hidden`` and ``weight``
    through autograd (DDP's and FSDP's hooks fire); ``weight`` must stay allocated until backward.
    """
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    return _LinearCrossEntropy.apply(hidden, weight, targets, int(chunk_tokens), dtype)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The `LlamaForCausalLM` under a DDP wrapper or a ``torch.compile`` one."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's wrapper
            model = model._orig_mod
        else:
            return model


def _logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(c, vocab) fp32 logits of (c, hidden) ``hidden`` and a (vocab, hidden) weight in ``dtype``."""
    return F.linear(hidden.to(dtype), weight).float()  # .float(): a new tensor only when dtype is not fp32


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-chunk recomputation: the forward keeps each token's logsumexp, not its logits; the
    backward recomputes one chunk's logits at a time and turns them into softmax - onehot.

    Why recompute rather than compute the gradients in the forward (as Liger-Kernel does): the
    backward then knows the incoming gradient (the fp16 loss scale, 1/accumulation steps) and
    applies it before casting to the matmul dtype, exactly as autograd does for the plain loss,
    so fp16 gradients neither underflow nor overflow differently; and nothing of size
    (vocab, hidden) waits from forward to backward. The price: one more lm_head matmul per chunk.
    Why not ``torch.utils.checkpoint`` per chunk: its per-chunk weight gradients would be summed
    by autograd in the matmul dtype (bf16); here they are summed in fp32.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        valid = targets != IGNORE_INDEX  # (N,)
        lse = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)  # (N,) logsumexp
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # (vocab, hidden), one cast for all chunks
            for start in range(0, targets.numel(), chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits = _logits(hidden[rows], w, dtype)  # (c, vocab) fp32
                picked = logits.gather(1, targets[rows].clamp(min=0).unsqueeze(1)).squeeze(1)  # (c,)
                top = logits.amax(dim=1)  # logsumexp in place: torch.logsumexp would need a second (c, vocab)
                lse[rows] = logits.sub_(top.unsqueeze(1)).exp_().sum(dim=1).log_().add_(top)
                total += torch.where(valid[rows], lse[rows] - picked, 0.0).sum()
                del logits
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, targets, lse, count)
        ctx.chunk_tokens, ctx.dtype = chunk_tokens, dtype
        return total / count

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, count = ctx.saved_tensors
        if weight.untyped_storage().nbytes() == 0:
            raise RuntimeError("lm_loss backward: the lm_head weight was freed after the forward (an FSDP2 "
                               "root resharded after forward?); keep fully_shard's default for the root")
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        chunk, dtype = ctx.chunk_tokens, ctx.dtype
        scale = torch.where(targets != IGNORE_INDEX, grad_loss.float() / count, 0.0)  # (N,) dloss/dlogit row
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, targets.numel(), chunk):
                rows = slice(start, start + chunk)
                h = hidden[rows].to(dtype)  # (c, hidden)
                g = _logits(h, w, dtype).sub_(lse[rows].unsqueeze(1)).exp_()  # (c, vocab) softmax
                g.scatter_add_(1, targets[rows].clamp(min=0).unsqueeze(1),
                               torch.full((g.shape[0], 1), -1.0, dtype=g.dtype, device=g.device))
                g = g.mul_(scale[rows].unsqueeze(1)).to(dtype)  # dloss/dlogits, then as the matmul's dtype
                if need_hidden:
                    grad_hidden[rows] = g @ w  # cast to hidden's dtype as autocast's backward would
                if need_weight and dtype == torch.float32:
                    grad_weight.addmm_(g.t(), h)  # (vocab, hidden)
                elif need_weight:
                    grad_weight += (g.t() @ h).float()  # each chunk rounded to dtype as F.linear's would be; summed in fp32
                del g  # before the next chunk's logits
        if need_weight and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None
