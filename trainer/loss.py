"""The training loss, mean next-token cross-entropy, without holding every token's logits at once.

`lm_loss` runs the model's root forward with no logits (``logits_to_keep``: an empty index), takes
the final normed hidden states from a forward hook on the decoder stack, and applies
`linear_cross_entropy`: the lm_head matmul and an fp32 log-softmax one chunk of tokens at a time
in the forward, one slice of the vocabulary at a time in the backward. Torch and transformers only. Never call the decoder
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
#: (rounded down to a multiple of 64), e.g. 2048 tokens at a 32k vocabulary, 512 at 128k; a chunk
#: holds about 1.5x this under bf16 autocast, 2x in fp32 (logits and log-probabilities). A
#: micro-batch whose logits fit in one chunk takes the plain path (chunking it would only add the
#: backward's recomputation); ``0`` sends every micro-batch down the plain path.
CHUNK_LOGITS_MIB = 256
#: Targets with this value add no loss and are left out of the mean (F.cross_entropy's default).
IGNORE_INDEX = -100
#: ``mean``: nats per target (nan when every target is ignored); ``sum``: nats summed over the
#: targets (0 when every one is ignored), for a caller that divides by a count of its own.
REDUCTIONS = ("mean", "sum")


def chunk_tokens_for(vocab_size: int, logits_mib: int = CHUNK_LOGITS_MIB) -> int:
    """Tokens per chunk for ``vocab_size`` (see `CHUNK_LOGITS_MIB`); 0 when ``logits_mib`` is 0."""
    if logits_mib <= 0:
        return 0
    return max(64, logits_mib * 2**18 // vocab_size // 64 * 64)  # 2**18 fp32 values per MiB


def plain_lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                  reduction: str = "mean", position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`lm_loss` the direct way: all ``(b, T, vocab)`` logits, then ``F.cross_entropy`` in fp32."""
    logits = model(input_ids=x, use_cache=False, **_positions(position_ids)).logits  # (b, T, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction=_checked(reduction))


def _positions(position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The forward's ``position_ids`` keyword when given (packed rows), else none: the model's own
    0 .. T-1 and plain causal attention."""
    return {} if position_ids is None else {"position_ids": position_ids}


def _checked(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}, expected one of {REDUCTIONS}")
    return reduction


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
            chunk_tokens: int | None = None, reduction: str = "mean",
            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Mean (or summed: ``reduction``, `REDUCTIONS`) next-token cross-entropy in nats per token
    (targets `IGNORE_INDEX` left out).

    Args:
        model: a transformers causal LM, bare, under FSDP2 (``fully_shard`` on the root), or wrapped
            in DDP; its decoder layers may be compiled one by one, its root not.
        x: (b, T) int64 input ids.
        y: (b, T) int64 targets (x shifted left by one).
        chunk_tokens: tokens per chunk; None: `chunk_tokens_for` the vocabulary. When ``b * T``
            is at most this (or it is 0), the plain path (`plain_lm_loss`).
        position_ids: (b, T) int64 or None. Packed rows (trainforge.trainer.packing): restarting
            at 0 for each example, which also masks attention per example.
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
    # softcapped logits (Gemma 2) are the model's own forward: the chunked path applies lm_head alone
    softcap = getattr(causal_lm.config, "final_logit_softcapping", None)
    if chunk_tokens <= 0 or y.numel() <= chunk_tokens or head.bias is not None or softcap:
        return plain_lm_loss(model, x, y, reduction, position_ids)

    captured: list[torch.Tensor] = []

    def keep_hidden(module: torch.nn.Module, args: Any, output: Any) -> None:
        captured.append(output[0])  # last_hidden_state, after the final norm: (b, T, hidden)

    hook = causal_lm.get_decoder().register_forward_hook(keep_hidden)
    try:
        # The root forward (FSDP2 unshards the embedding, final norm and lm_head for it) with an
        # empty logits_to_keep: lm_head sees (b, 0, hidden) and computes no logits.
        model(input_ids=x, use_cache=False, logits_to_keep=torch.empty(0, dtype=torch.long, device=x.device),
              **_positions(position_ids))
    finally:
        hook.remove()
    weight = head.weight  # (vocab, hidden); FSDP2: the root's unsharded parameter until its post-backward
    if isinstance(weight, DTensor):
        raise RuntimeError("lm_loss: the lm_head weight is sharded after the root forward (FSDP2 root with "
                           "reshard_after_forward=True?); fully_shard the root with the default, or set "
                           "trainforge.trainer.loss.CHUNK_LOGITS_MIB = 0 for the plain loss")
    return linear_cross_entropy(captured[0].flatten(0, 1), weight, y.flatten(), chunk_tokens, reduction)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_tokens: int, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction=reduction)``,
    ``chunk_tokens`` rows at a time.

    Args:
        hidden: (N, hidden) final hidden states.
        weight: (vocab, hidden) lm_head weight.
        targets: (N,) int64 token ids, or `IGNORE_INDEX`.
        chunk_tokens: rows per chunk; memory holds one chunk's (chunk_tokens, vocab) logits.
    Returns:
        scalar float32 mean over the targets that are not `IGNORE_INDEX` (nan if none), or their
        sum (0 if none) with ``reduction="sum"``.

    The matmuls run in the autocast dtype when autocast is on (as ``F.linear`` would), else in
    ``hidden``'s dtype; softmax and loss in fp32. Gradients reach ``hidden`` and ``weight``
    through autograd (DDP's and FSDP's hooks fire); ``weight`` must stay allocated until backward.
    """
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    return _LinearCrossEntropy.apply(hidden, weight, targets, int(chunk_tokens), dtype,
                                     _checked(reduction) == "mean")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM under a DDP wrapper or a ``torch.compile`` one."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's wrapper
            model = model._orig_mod
        else:
            return model


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-chunk recomputation. The forward goes through the tokens ``chunk_tokens`` rows at a
    time and keeps each token's logsumexp, not its logits. The backward recomputes the logits a
    slice of the vocabulary at a time (as many elements as a chunk: all N rows, chunk_tokens * vocab
    / N columns), turns them into (softmax - onehot) * dloss, writes that slice's rows of the
    weight gradient in one matmul over all tokens (as F.linear's backward does: one rounding to
    the matmul dtype) and adds its share of the hidden gradient into an fp32 (N, hidden) buffer
    (slicing the vocabulary, not the tokens, for the backward: that buffer is N x hidden rather
    than vocab x hidden, read and written once per slice).

    Why recompute rather than compute the gradients in the forward (as Liger-Kernel does): the
    backward then knows the incoming gradient (the fp16 loss scale, 1/accumulation steps) and
    applies it before casting to the matmul dtype, exactly as autograd does for the plain loss,
    so fp16 gradients neither underflow nor overflow differently; and nothing of size
    (vocab, hidden) waits from forward to backward. The price: one more lm_head matmul (4 instead
    of 3). Why not ``torch.utils.checkpoint`` per chunk: autograd would sum the chunks' weight
    gradients in the matmul dtype (bf16), each chunk a (vocab, hidden) read and write.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int, dtype: torch.dtype, mean: bool) -> torch.Tensor:
        valid = targets != IGNORE_INDEX  # (N,)
        index = targets.clamp(min=0).unsqueeze(1)  # (N, 1); ignored rows read column 0, counted 0
        lse = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)  # (N,) logsumexp
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # (vocab, hidden), one cast for all chunks
            for start in range(0, targets.numel(), chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits = F.linear(hidden[rows].to(dtype), w)  # (c, vocab) in dtype
                logp = torch.log_softmax(logits, dim=1, dtype=torch.float32).gather(1, index[rows]).squeeze(1)
                lse[rows] = logits.gather(1, index[rows]).squeeze(1).float() - logp  # x_t - log p_t
                total -= torch.where(valid[rows], logp, 0.0).sum()
                del logits
        count = valid.sum() if mean else torch.ones((), dtype=torch.long, device=hidden.device)  # sum: no division
        ctx.save_for_backward(hidden, weight, targets, lse, count)
        ctx.chunk_tokens, ctx.dtype = chunk_tokens, dtype
        return total / count if mean else total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, count = ctx.saved_tensors
        if weight.untyped_storage().nbytes() == 0:
            raise RuntimeError("lm_loss backward: the lm_head weight was freed after the forward (an FSDP2 "
                               "root resharded after forward?); keep fully_shard's default for the root")
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        dtype = ctx.dtype
        n, vocab = targets.numel(), weight.shape[0]
        # vocabulary slice: (N, columns) logits, a multiple of 64 columns so that their rows stay aligned
        columns = max(64, ctx.chunk_tokens * vocab // n // 64 * 64)
        scale = torch.where(targets != IGNORE_INDEX, grad_loss.float() / count, 0.0).unsqueeze(1)  # (N, 1)
        lse = lse.unsqueeze(1)  # (N, 1)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)  # (N, hidden), one cast for all slices
            for start in range(0, vocab, columns):
                cols = slice(start, start + columns)
                w = weight[cols].to(dtype)  # (v, hidden)
                logits = F.linear(h, w)  # (N, v) in dtype
                g = logits.sub_(lse) if logits.dtype == torch.float32 else torch.sub(logits, lse)  # fp32
                del logits
                g.exp_()  # softmax
                hit = (targets >= start) & (targets < start + w.shape[0])  # the target is in this slice
                g.scatter_add_(1, (targets - start).clamp(0, w.shape[0] - 1).unsqueeze(1),
                               torch.where(hit, -1.0, 0.0).unsqueeze(1))  # softmax - onehot, in fp32
                g = torch.mul(g, scale, out=g if dtype == torch.float32 else torch.empty_like(g, dtype=dtype))
                if need_weight:
                    grad_weight[cols] = g.t() @ h  # (v, hidden): one matmul over all tokens
                if need_hidden and dtype == torch.float32:
                    grad_hidden.addmm_(g, w)
                elif need_hidden:
                    grad_hidden += g @ w  # each slice rounded to dtype, summed in fp32
                del g  # before the next slice's logits
        if need_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None
