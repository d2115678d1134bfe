"""The model: a small Llama-style causal LM built from a config (never downloaded).

`llama_config` maps the job config's ``model`` section plus the dataset's vocabulary onto
`transformers.LlamaConfig`; `build_model` instantiates `LlamaForCausalLM` with fresh weights
(initialised from torch's global RNG, so seed first). The same function serves the trainer, the
validator and the exporter, so the three always agree on parameter names and shapes.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.config import ModelConfig


def llama_config(model: ModelConfig, vocab_size: int, eos_id: int, max_positions: int) -> LlamaConfig:
    """The `LlamaConfig` for a job's model section.

    Args:
        vocab_size: rows of the embedding, from the dataset manifest.
        eos_id: used as the EOS, BOS and padding id (the datasets have one special token).
        max_positions: ``data.sequence_length``; rotary embeddings extrapolate past it but
            the model was never trained there.
    """
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        attention_dropout=model.dropout,
        tie_word_embeddings=model.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=False,
    )


def build_model(config: LlamaConfig) -> LlamaForCausalLM:
    """A freshly initialised `LlamaForCausalLM` in fp32 on the CPU (move it afterwards)."""
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats per token.

    Args:
        x: (b, T) int64 input ids.
        y: (b, T) int64 targets (x shifted left by one).
    Returns:
        scalar float32 tensor (computed in fp32 even under bf16 autocast).
    """
    logits = model(input_ids=x, use_cache=False).logits  # (b, T, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def enable_activation_checkpointing(model: LlamaForCausalLM) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of storing them.

    Uses transformers' own wrapping of the decoder layers with non-reentrant
    `torch.utils.checkpoint` (``use_reentrant=False``: works with DDP and FSDP2, with inputs
    that do not require grad, and recomputes with the same RNG state, so dropout matches).
    Active only in ``model.train()`` mode. Call before wrapping the model in DDP or FSDP.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: name}`` for state-dict names whose tensor is an earlier name's (tied weights).

    E.g. ``{"lm_head.weight": "model.embed_tokens.weight"}`` with ``tie_word_embeddings``.
    Call on an unsharded model (it compares storage pointers).
    """
    seen: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            aliases[name] = seen[ptr]
        else:
            seen[ptr] = name
    return aliases


def tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """State-dict names that alias an earlier tensor (e.g. ``lm_head.weight`` when tied).

    safetensors refuses aliased tensors, so checkpoints store each storage once; loading
    tolerates exactly these names being absent.
    """
    return set(tied_aliases(model))


def weights_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors without aliases, detached, contiguous, on the CPU."""
    skip = tied_parameter_names(model)
    return {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items() if name not in skip}


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (as written by `weights_state_dict`) into ``model`` in place.

    Raises:
        ValueError: a name is unknown or missing (other than a tied alias), or a shape differs.
    """
    check_weights({n: t.shape for n, t in model.state_dict().items()}, tied_parameter_names(model), tensors)
    model.load_state_dict(tensors, strict=False)


def check_weights(expected: dict[str, torch.Size], tied: set[str], tensors: dict[str, torch.Tensor]) -> None:
    """Check ``tensors`` has every name of ``expected`` (but the ``tied`` aliases) with its shape.

    Raises:
        ValueError: a name is unknown or missing (other than a tied alias), or a shape differs.
    """
    missing = sorted(set(expected) - set(tensors) - tied)
    unknown = sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(tensors) & set(expected) if tensors[n].shape != expected[n])
    if missing or unknown or wrong:
        shapes = ", ".join(f"{n}: {tuple(tensors[n].shape)} vs model {tuple(expected[n])}" for n in wrong[:5])
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unknown {unknown[:5]}, "
                         f"shape mismatch [{shapes}]")
