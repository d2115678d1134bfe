"""trainforge.trainer.train pieces that need no process: learning-rate schedule, optimizer parameter groups."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from trainforge.trainer.config import ModelConfig, OptimConfig
from trainforge.trainer.model import build_model, llama_config
from trainforge.trainer.optim import make_optimizer
from trainforge.trainer.train import lr_at

OPTIM = OptimConfig(
    max_steps=110,
    global_batch_size=8,
    micro_batch_size=2,
    learning_rate=1e-3,
    min_learning_rate=1e-4,
    warmup_steps=10,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,
    seed=0,
)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 1e-4),  # warm-up: lr_max * 1/10
        (4, 5e-4),  # lr_max * 5/10
        (9, 1e-3),  # last warm-up step reaches the peak
        (10, 1e-3),  # cosine starts at the peak (progress 0)
        (60, 1e-4 + 0.5 * 9e-4),  # progress 0.5: half way between peak and floor
        (
            109,
            1e-4 + 0.5 * (1 + math.cos(math.pi * 99 / 100)) * 9e-4,
        ),  # last step, just above the floor
        (500, 1e-4),  # past max_steps: the floor
    ],
)
def test_lr_schedule_values(step, expected):
    assert lr_at(step, OPTIM) == pytest.approx(expected, rel=1e-12)


def test_lr_schedule_without_warmup_and_monotone_decay():
    optim = dataclasses.replace(OPTIM, warmup_steps=0)
    values = [lr_at(s, optim) for s in range(optim.max_steps)]
    assert values[0] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[-1] > optim.min_learning_rate


def test_weight_decay_only_on_matrices():
    model = build_model(
        llama_config(ModelConfig("llama", 32, 2, 4, 2, 64, 1e4, 0.0, True), 300, 0, 32)
    )
    decay, no_decay = make_optimizer(model, OPTIM).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(
        p.dim() == 1 for p in no_decay["params"]
    )
    assert len(decay["params"]) + len(no_decay["params"]) == len(
        list(model.parameters())
    )  # tied once
    assert any(p is model.model.embed_tokens.weight for p in decay["params"])
    assert isinstance(no_decay["params"][0], torch.nn.Parameter)

