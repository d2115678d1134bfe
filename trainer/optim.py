"""The optimizer of a training job and the decision to take each of its steps.

`make_optimizer` builds AdamW over the trainable parameters (LoRA: the adapters alone);
`should_step` refuses a non-finite step (divergence) and lets an fp16 overflow skip one.
"""

from __future__ import annotations

import math

import torch

from trainforge.trainer.amp import MIN_LOSS_SCALE
from trainforge.trainer.config import OptimConfig
from trainforge.trainer.errors import DivergedError


def make_optimizer(model: torch.nn.Module, o: OptimConfig, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on 2-D+ parameters (matmuls, embeddings) only, not on norms.

    ``fused``: one fused kernel for the whole update (`fused_adamw_supported` decides when None);
    else torch's default (foreach). Both keep the same state_dict, so a checkpoint written by one
    resumes in the other.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if fused is None:
        fused = fused_adamw_supported(params)
    return torch.optim.AdamW(groups, lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=1e-8,
                             fused=fused or None)


def fused_adamw_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters: floating point, all on one device
    type that has the kernel (CUDA; also the CPU in torch >= 2.4)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # the list torch checks

    kinds = {p.device.type for p in params}
    return (len(kinds) == 1 and kinds <= set(_get_fused_kernels_supported_devices())
            and all(torch.is_floating_point(p) for p in params))


def should_step(step: int, loss: float, grad_norm: float, lr: float, loss_scale: float | None) -> bool:
    """Whether optimizer step ``step`` (1-based) may be taken; False: an fp16 overflow, skip it.

    Args:
        loss: mean train loss of the step over all ranks, nats/token.
        grad_norm: global L2 norm of the (unscaled) gradients.
        loss_scale: the fp16 loss scale before this step's update, None for fp32/bf16.
    Raises:
        DivergedError: the loss is not finite; or the gradient norm is not finite without
            loss scaling, or with a loss scale already below `MIN_LOSS_SCALE`.
    """
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return True
    if math.isfinite(loss) and loss_scale is not None and loss_scale >= MIN_LOSS_SCALE:
        return False  # fp16 overflow: GradScaler skips the step and halves the scale
    scale = f", loss scale {loss_scale:g} (below {MIN_LOSS_SCALE:g})" if loss_scale is not None else ""
    raise DivergedError(f"step {step}: train loss {loss}, grad norm {grad_norm} at lr {lr:.3g}{scale}; "
                        f"stopping before the optimizer step, no checkpoint written after step {step - 1}")
