"""Learning-rate schedules: linear warm-up, then cosine, linear or no decay (``optim.lr_schedule``).

A pure function of the step index, so a resumed run continues on exactly the same curve: the
checkpoint only needs the step (``trainer_state.pt`` ``scheduler.step``).
"""

from __future__ import annotations

import math

from trainforge.trainer.config import OptimConfig


def lr_at(step: int, optim: OptimConfig) -> float:
    """Learning rate of the optimizer step with 0-based index ``step``.

    W = warmup_steps, S = max_steps, lr_max = learning_rate, lr_min = min_learning_rate:

        step < W:   lr = lr_max * (step + 1) / W                             # linear warm-up
        step >= W:  p = min(1, (step - W) / max(1, S - W))                   # in [0, 1) up to S
            cosine:    lr = lr_min + 0.5 * (1 + cos(pi * p)) * (lr_max - lr_min)
            linear:    lr = lr_max - p * (lr_max - lr_min)
            constant:  lr = lr_max                                           # lr_min unused

    The cosine form is the SGDR/"cosine annealing" schedule without restarts (Loshchilov &
    Hutter, 2017, eq. 5); warm-up as in Goyal et al., 2017. Past ``max_steps`` (only reachable
    by calling this directly) the decaying schedules stay at ``lr_min``.

    Raises:
        ValueError: ``optim.lr_schedule`` is not one of the three (the config parser already
            rejects that, so this means a hand-built `OptimConfig`).
    """
    o = optim
    if step < o.warmup_steps:
        return o.learning_rate * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, o.max_steps - o.warmup_steps))
    span = o.learning_rate - o.min_learning_rate
    if o.lr_schedule == "cosine":
        return o.min_learning_rate + 0.5 * (1.0 + math.cos(math.pi * progress)) * span
    if o.lr_schedule == "linear":
        return o.learning_rate - progress * span
    if o.lr_schedule == "constant":
        return o.learning_rate
    raise ValueError(f"optim.lr_schedule={o.lr_schedule!r}: expected 'cosine', 'linear' or 'constant'")
