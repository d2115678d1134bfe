"""Mixed precision of the trainer (job config ``precision``): autocast, and loss scaling for fp16.

| precision | forward/backward                     | loss scaling                                  |
|-----------|--------------------------------------|-----------------------------------------------|
| fp32      | fp32                                 | none                                          |
| bf16      | `torch.autocast` bfloat16            | none (bf16 has fp32's exponent range)         |
| fp8       | float8 linears (trainer/float8.py),  | none                                          |
|           | the rest under bfloat16 autocast     |                                               |
| fp16      | `torch.autocast` float16             | `torch.amp.GradScaler`; `ShardedGradScaler`   |
|           |                                      | under FSDP (it all-reduces the overflow flag  |
|           |                                      | that each rank finds in its own shards)       |

Weights, gradients and optimizer state stay fp32 in every mode ("master weights"). torch 2.13
runs float16 autocast on the CPU as well as on CUDA (checked: matmuls return float16, GradScaler
works with device "cpu"), so every mode runs on both.

The scaler's state (scale, growth tracker) is part of the checkpoint (``trainer_state.pt``
``grad_scaler``) so that an fp16 run resumes exactly.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

# The loss scale starts at 2**16 (GradScaler's default) and halves on every overflow. Below 1
# even the unscaled fp16 backward overflows: that is divergence, not a range problem.
MIN_LOSS_SCALE = 1.0


class Precision:
    """Autocast context and (for fp16) the gradient scaler of one training run.

    Args:
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"`` (checked by the config parser).
        device: where the model runs; autocast and the scaler follow its type.
        sharded: the parameters are FSDP-sharded (use `ShardedGradScaler`).
    """

    def __init__(self, precision: str, device: torch.device, sharded: bool) -> None:
        self.precision = precision
        self.device_type = device.type
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                      "fp8": torch.bfloat16}[precision]
        self.scaler: torch.amp.GradScaler | None = None
        if precision == "fp16" and sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # FSDP only: startup cost

            self.scaler = ShardedGradScaler(device.type)
        elif precision == "fp16":
            self.scaler = torch.amp.GradScaler(device.type)

    def autocast(self) -> AbstractContextManager:
        """Context for the forward pass (and the loss): autocast to the dtype, or nothing for fp32."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the scaled loss under fp16."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale (before clipping); records overflow for `step`."""
        if self.scaler:
            with warnings.catch_warnings():
                # ShardedGradScaler hands a (1,) overflow flag to ops on DTensor gradients; DTensor
                # replicates it as intended but warns each time.
                warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1",
                                        category=UserWarning)
                self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under fp16 skipped on overflow, then the scale is updated."""
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def loss_scale(self) -> float | None:
        """The current loss scale (fp16), else None."""
        return self.scaler.get_scale() if self.scaler else None

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the scaler (floats and ints), or None without one."""
        return self.scaler.state_dict() if self.scaler else None

    def load_state_dict(self, state: dict[str, Any] | None) -> bool:
        """Restore `state_dict`'s output; returns False (and changes nothing) if there is none to load."""
        if not (self.scaler and state):
            return False
        self.scaler.load_state_dict(state)
        return True
