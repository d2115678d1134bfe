"""The trainer's startup check: the model about to take step 1 is whole and is the one its config describes.

`check_model` runs once after the initial weights (built, pretrained or ``init``) and any checkpoint
are loaded, before the first step: no parameter or buffer on the meta device, every one finite, the
weights the model ties sharing storage, and rotary inverse frequencies equal to transformers' own
computation from the config. A failure is a `ConfigError` (exit 78, permanent) naming the tensor,
raised on every rank together. It only reads the model, never changes it (docs/trainer.md,
"The startup check").
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.distributed as dist

from trainforge.trainer.distributed import Dist
from trainforge.trainer.errors import ConfigError

log = logging.getLogger(__name__)

#: Relative difference allowed between a rotary buffer and transformers' recomputation of it: the
#: same float32 formula on another device may round differently in the last bit, nothing more.
ROPE_RTOL = 1e-5
#: RoPE types whose ``inv_freq`` follows the sequence length at run time (transformers'
#: ``dynamic_rope_update``): only their ``original_inv_freq`` is fixed by the config.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def model_problems(model: torch.nn.Module) -> list[str]:
    """What is wrong with this rank's view of ``model`` (local shards under FSDP2), one
    ``"<tensor name>: <what>"`` per problem; [] when it may train.

    Checked: parameters and buffers on meta, non-finite values, the pairs of
    ``model.all_tied_weights_keys`` (transformers' record of what the config ties) not sharing
    storage, and each rotary embedding's ``inv_freq`` / ``original_inv_freq`` against
    `reference_inv_freq`. LoRA adapters are parameters like the others.
    """
    problems = []
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in tensors:
        local = _local(tensor)
        if local.is_meta:
            problems.append(f"{name}: still on the meta device (never materialised or loaded)")
        elif (local.is_floating_point() or local.is_complex()) and not bool(torch.isfinite(local).all()):
            bad = local.detach()[~torch.isfinite(local.detach())]
            problems.append(f"{name}: {bad.numel()} of {local.numel()} values are not finite "
                            f"(first: {bad.flatten()[0].item()})")
    on_meta = {name for name, tensor in tensors if _local(tensor).is_meta}
    for alias, source in sorted((getattr(model, "all_tied_weights_keys", None) or {}).items()):
        problem = _tie_problem(model, alias, source, on_meta)
        if problem:
            problems.append(problem)
    for name, module in model.named_modules():
        if "inv_freq" in module._buffers and "original_inv_freq" in module._buffers:  # noqa: SLF001
            problems += _rotary_problems(f"{name}." if name else "", module, on_meta)
    return problems


def check_model(model: torch.nn.Module, d: Dist) -> None:
    """Refuse to train a broken ``model`` (`model_problems` on every rank); a collective.

    Every rank must call it. The ranks agree through one all-reduced flag (FSDP2: a NaN may sit in
    one rank's shard only), then gather the problems, so that all raise the same error.

    Raises:
        ConfigError: naming each tensor and what is wrong with it, and on which ranks.
    """
    problems = model_problems(model)
    flag = torch.tensor([int(bool(problems))], device=d.device)
    if d.enabled:
        dist.all_reduce(flag)
    if not int(flag.item()):
        log.info("startup check: every parameter and buffer is materialised and finite, tied weights are tied, "
                 "rotary frequencies are the config's")
        return
    by_rank = [problems]
    if d.enabled:
        by_rank = [None] * d.world_size
        dist.all_gather_object(by_rank, problems)
    ranks: dict[str, list[int]] = {}
    for rank, found in enumerate(by_rank):
        for problem in found:
            ranks.setdefault(problem, []).append(rank)
    listed = "; ".join(problem + (f" (rank {', '.join(map(str, r))})" if d.enabled else "")
                       for problem, r in list(ranks.items())[:8])
    more = f"; and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    raise ConfigError(f"startup check: the model is broken before step 1 ({listed}{more}); the weights or "
                      f"config.json it was loaded from hold this, training did not cause it: fix the model "
                      f"folder, init checkpoint or model config")


def reference_inv_freq(module: torch.nn.Module) -> torch.Tensor | None:
    """transformers' inverse frequencies for a rotary module's config, computed afresh on the CPU:
    ``ROPE_INIT_FUNCTIONS[rope_type]``, or the module class's own ``compute_default_rope_parameters``
    for ``default``; None for a RoPE type neither knows.

    Returns:
        (head_dim // 2,) float32, or None.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = getattr(module, "rope_type", None)
    init = ROPE_INIT_FUNCTIONS.get(rope_type) or getattr(type(module), f"compute_{rope_type}_rope_parameters", None)
    config = getattr(module, "config", None)
    if init is None or config is None:
        return None
    inv_freq, _ = init(config)
    return inv_freq.detach().float().cpu()


def _rotary_problems(prefix: str, module: torch.nn.Module, on_meta: set[str]) -> list[str]:
    reference = reference_inv_freq(module)
    if reference is None:
        log.warning("startup check: %s has RoPE type %r, which transformers' initialisation does not know: its "
                    "frequencies are checked for finiteness only", prefix.rstrip(".") or "the model",
                    getattr(module, "rope_type", None))
        return []
    rope_type = getattr(module, "rope_type", None)
    names = ("original_inv_freq",) if rope_type in LENGTH_DEPENDENT_ROPE else ("inv_freq", "original_inv_freq")
    problems = []
    for buffer in names:
        name, value = prefix + buffer, module._buffers[buffer]  # noqa: SLF001
        if name in on_meta:
            continue  # reported as on meta already
        got = value.detach().float().cpu()
        if got.shape != reference.shape:
            problems.append(f"{name}: shape {list(got.shape)}, but the config implies {list(reference.shape)} "
                            f"(rope_type {rope_type!r})")
            continue
        if not bool(torch.isfinite(got).all()):
            continue  # reported as not finite already
        wrong = ~torch.isclose(got, reference, rtol=ROPE_RTOL, atol=0.0)
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0, 0])
            problems.append(f"{name}: {int(wrong.sum())} of {got.numel()} rotary inverse frequencies differ from "
                            f"what the config implies (rope_type {rope_type!r}): index {i} is {got[i].item():.6g}, "
                            f"expected {reference[i].item():.6g}")
    return problems


def _tie_problem(model: torch.nn.Module, alias: str, source: str, on_meta: set[str]) -> str | None:
    a, b = _parameter(model, alias), _parameter(model, source)
    if a is None or b is None:
        return f"{alias}: tied to {source} by the config, but {alias if a is None else source} is not a parameter"
    if alias in on_meta or source in on_meta:
        return None  # reported as on meta already
    if a is b or _local(a).data_ptr() == _local(b).data_ptr():
        return None
    return (f"{alias}: the config ties it to {source} (tie_word_embeddings), but it is a separate tensor: "
            f"the two would train apart")


def _parameter(model: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The parameter ``name``, or where LoRA moved it (``<module>.base_layer.<name>``)."""
    module, _, leaf = name.rpartition(".")
    for candidate in (name, f"{module}.base_layer.{leaf}" if module else f"base_layer.{leaf}"):
        try:
            return model.get_parameter(candidate)
        except AttributeError:
            continue
    return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor, else the tensor itself."""
    if "torch.distributed.tensor" not in sys.modules:  # then no tensor is a DTensor
        return tensor
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
