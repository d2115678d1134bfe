"""The job config's ``optim.lr_schedule``, ``precision`` and ``framework`` keys, without processes.

Schedules (values from the documented formulas), config checks (one table row per rejected
value), defaults for job configs written before these keys, activation checkpointing (same loss
and gradients, layers really recomputed), fp16 loss scaling and the step/skip/diverge rule, and
the optimizer-state renumbering that keeps FSDP checkpoints in the DDP layout.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from trainforge.trainer.amp import MIN_LOSS_SCALE, Precision
from trainforge.trainer.config import FrameworkConfig, ModelConfig, OptimConfig, parse_job_config
from trainforge.trainer.errors import ConfigError, DivergedError
from trainforge.trainer.model import build_model, enable_activation_checkpointing, llama_config, lm_loss
from trainforge.trainer.parallel import Parallel, optimizer_state_by_index, optimizer_state_by_name
from trainforge.trainer.schedule import lr_at
from trainforge.trainer.optim import make_optimizer, should_step

# W = 10 warm-up steps, S = 110: decay over 100 steps from 1e-3 to 1e-4.
OPTIM = OptimConfig(max_steps=110, global_batch_size=8, micro_batch_size=2, learning_rate=1e-3,
                    min_learning_rate=1e-4, warmup_steps=10, weight_decay=0.1, beta1=0.9, beta2=0.95,
                    grad_clip=1.0, seed=0)
TINY = ModelConfig("llama", 32, 2, 4, 2, 64, 1e4, 0.0, True)

SCHEDULE_ROWS = [
    # (schedule, step, expected lr)
    ("linear", 0, 1e-4),  # warm-up is the same for every schedule: lr_max * 1/10
    ("linear", 9, 1e-3),  # end of warm-up: the peak
    ("linear", 10, 1e-3),  # decay starts at the peak (progress 0)
    ("linear", 35, 1e-3 - 0.25 * 9e-4),  # progress 1/4
    ("linear", 60, 1e-4 + 0.5 * 9e-4),  # progress 1/2: half way, like cosine
    ("linear", 109, 1e-3 - 0.99 * 9e-4),  # last step: one step above the floor
    ("linear", 500, 1e-4),  # past max_steps: the floor
    ("constant", 0, 1e-4),
    ("constant", 10, 1e-3),
    ("constant", 109, 1e-3),  # no decay: min_learning_rate is not used
    ("constant", 500, 1e-3),
    ("cosine", 35, 1e-4 + 0.5 * (1 + math.cos(math.pi / 4)) * 9e-4),  # progress 1/4
    ("cosine", 60, 1e-4 + 0.5 * 9e-4),
]


@pytest.mark.parametrize(("schedule", "step", "expected"), SCHEDULE_ROWS,
                         ids=[f"{r[0]}-{r[1]}" for r in SCHEDULE_ROWS])
def test_schedule_values(schedule, step, expected):
    assert lr_at(step, dataclasses.replace(OPTIM, lr_schedule=schedule)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedules_without_warmup_never_increase(schedule):
    optim = dataclasses.replace(OPTIM, warmup_steps=0, lr_schedule=schedule)
    values = [lr_at(s, optim) for s in range(optim.max_steps)]
    assert values[0] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert all(optim.min_learning_rate <= v <= optim.learning_rate for v in values)


def test_linear_schedule_steps_down_evenly():
    optim = dataclasses.replace(OPTIM, lr_schedule="linear")
    drops = {round(lr_at(s, optim) - lr_at(s + 1, optim), 15) for s in range(10, 109)}
    assert drops == {round(9e-4 / 100, 15)}


def test_hand_built_unknown_schedule_raises():
    with pytest.raises(ValueError, match="optim.lr_schedule='step'"):
        lr_at(50, dataclasses.replace(OPTIM, lr_schedule="step"))


# --- config -------------------------------------------------------------------------------------

FRAMEWORK = {"parallelism": "ddp", "gradient_compression": "none", "powersgd_rank": 1,
             "activation_checkpointing": False}


def _job(valid_job: dict, framework: dict | None = None, **top) -> dict:
    job = copy.deepcopy(valid_job)
    if framework is not None:
        job["framework"] = {**FRAMEWORK, **framework}
    for dotted, value in top.items():
        section, key = dotted.split("__")
        job[section][key] = value
    return job


ERROR_ROWS = [
    # (framework override, top-level overrides, message fragment)
    ({}, {"optim__lr_schedule": "step"},
     "optim.lr_schedule='step': expected one of ['cosine', 'linear', 'constant']"),
    ({}, {"optim__lr_schedule": 1}, "optim.lr_schedule=1 (int): expected a non-empty string"),
    ({"parallelism": "zero3"}, {}, "framework.parallelism='zero3': expected one of ['ddp', 'fsdp']"),
    ({"parallelism": "FSDP"}, {}, "framework.parallelism='FSDP': expected one of ['ddp', 'fsdp']"),
    ({"gradient_compression": "int8"}, {},
     "framework.gradient_compression='int8': expected one of ['none', 'fp16', 'bf16', 'powersgd']"),
    ({"gradient_compression": None}, {}, "framework.gradient_compression=None (NoneType): expected a non-empty"),
    ({"powersgd_rank": 0}, {}, "framework.powersgd_rank=0: expected a value >= 1"),
    ({"powersgd_rank": 1.5}, {}, "framework.powersgd_rank=1.5 (float): expected an integer"),
    ({"activation_checkpointing": "yes"}, {},
     "framework.activation_checkpointing='yes' (str): expected true or false"),
    ({"sharding": "full"}, {}, "unknown field(s) framework.sharding"),
    ({"parallelism": "fsdp", "gradient_compression": "powersgd"}, {},
     "framework.gradient_compression='powersgd' is a DDP communication hook and does not apply to "
     "framework.parallelism='fsdp'"),
    ({"parallelism": "fsdp", "gradient_compression": "fp16"}, {}, "expected 'none' with 'fsdp'"),
]


@pytest.mark.parametrize(("framework", "top", "fragment"), ERROR_ROWS, ids=[r[2][:40] for r in ERROR_ROWS])
def test_framework_config_errors(valid_job, framework, top, fragment):
    with pytest.raises(ConfigError) as info:
        parse_job_config(_job(valid_job, framework, **top))
    assert fragment in str(info.value)
    assert info.value.exit_code == 78


def test_framework_must_be_an_object(valid_job):
    job = copy.deepcopy(valid_job)
    job["framework"] = "ddp"
    with pytest.raises(ConfigError, match=r"framework: expected a JSON object, got 'ddp' \(str\)"):
        parse_job_config(job)


def test_older_job_config_without_the_new_keys_gets_the_defaults(valid_job):
    assert "framework" not in valid_job and "lr_schedule" not in valid_job["optim"]  # conftest's BASE_JOB
    cfg = parse_job_config(valid_job)
    assert cfg.framework == FrameworkConfig("ddp", "none", 1, False)
    assert cfg.optim.lr_schedule == "cosine" and cfg.precision == "fp32"
    assert cfg.raw == valid_job  # kept verbatim: defaults are not written into meta.json's job_config


def test_partial_framework_section_fills_in_defaults(valid_job):
    job = copy.deepcopy(valid_job)
    job["framework"] = {"activation_checkpointing": True}
    assert parse_job_config(job).framework == FrameworkConfig(activation_checkpointing=True)


@pytest.mark.parametrize(("framework", "precision", "schedule"), [
    ({"parallelism": "fsdp", "activation_checkpointing": True}, "fp16", "linear"),
    ({"gradient_compression": "powersgd", "powersgd_rank": 4}, "bf16", "constant"),
    ({"gradient_compression": "bf16"}, "fp32", "cosine"),
])
def test_full_framework_section_parses(valid_job, framework, precision, schedule):
    cfg = parse_job_config(_job(valid_job, framework, optim__lr_schedule=schedule) | {"precision": precision})
    assert cfg.framework == FrameworkConfig(**{**FRAMEWORK, **framework})
    assert cfg.precision == precision and cfg.optim.lr_schedule == schedule


# --- activation checkpointing --------------------------------------------------------------------

def _loss_and_grads(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    model = build_model(llama_config(dataclasses.replace(TINY, dropout=0.1), 300, 0, 16))
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    mlp_calls = []  # a pre-hook: recomputation stops early, after the last activation it needs
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *args: mlp_calls.append(1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 300, (2, 16), generator=gen)  # (batch, seq_len) int64
    y = torch.randint(0, 300, (2, 16), generator=gen)
    torch.manual_seed(2)  # dropout masks: checkpointing replays the RNG state on recompute
    loss = lm_loss(model, x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(mlp_calls)


def test_activation_checkpointing_recomputes_with_equal_loss_and_gradients():
    loss_off, grads_off, calls_off = _loss_and_grads(False)
    loss_on, grads_on, calls_on = _loss_and_grads(True)
    assert (calls_off, calls_on) == (1, 2)  # the layer really ran again in the backward pass
    torch.testing.assert_close(loss_on, loss_off, rtol=0, atol=1e-6)
    assert grads_on.keys() == grads_off.keys()
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=1e-5, atol=1e-6, msg=name)


# --- precision ---------------------------------------------------------------------------------

def test_fp16_autocast_runs_on_the_cpu():
    amp = Precision("fp16", torch.device("cpu"), sharded=False)
    with amp.autocast():
        out = torch.ones(2, 3) @ torch.ones(3, 2)
    assert out.dtype == torch.float16 and amp.scaler is not None


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_no_scaler_without_fp16(precision, dtype):
    amp = Precision(precision, torch.device("cpu"), sharded=False)
    with amp.autocast():
        out = torch.ones(2, 3) @ torch.ones(3, 2)
    assert out.dtype == dtype and amp.scaler is None and amp.state_dict() is None
    assert not amp.load_state_dict({"scale": 2.0})


def test_fp16_scaler_state_round_trips():
    first = Precision("fp16", torch.device("cpu"), sharded=False)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    first.backward((w * float("inf")).sum())  # an overflow: the step is skipped, the scale halves
    first.unscale(opt)
    first.step(opt)
    assert torch.equal(w.detach(), torch.ones(3)) and first.loss_scale() == 2.0**15
    second = Precision("fp16", torch.device("cpu"), sharded=False)
    assert second.load_state_dict(first.state_dict())
    assert second.loss_scale() == 2.0**15 and second.state_dict() == first.state_dict()


STEP_ROWS = [
    # (loss, grad_norm, loss_scale, expected: True = step, False = skip, None = DivergedError)
    (3.2, 0.9, None, True),
    (3.2, 0.9, 65536.0, True),
    (3.2, math.inf, 65536.0, False),  # fp16 overflow: skip, the scaler halves the scale
    (3.2, math.nan, MIN_LOSS_SCALE, False),
    (3.2, math.inf, MIN_LOSS_SCALE / 2, None),  # the scale collapsed: diverged
    (3.2, math.inf, None, None),  # fp32/bf16: a non-finite gradient norm is divergence
    (math.nan, 0.9, None, None),
    (math.inf, math.inf, 65536.0, None),  # a non-finite loss is divergence even under fp16
]


@pytest.mark.parametrize(("loss", "grad_norm", "scale", "expected"), STEP_ROWS)
def test_should_step(loss, grad_norm, scale, expected):
    if expected is None:
        with pytest.raises(DivergedError, match="step 7: train loss"):
            should_step(7, loss, grad_norm, 1e-3, scale)
    else:
        assert should_step(7, loss, grad_norm, 1e-3, scale) is expected


# --- checkpoint layout under FSDP ---------------------------------------------------------------

def test_optimizer_state_renumbering_round_trips():
    model = build_model(llama_config(TINY, 300, 0, 16))
    optimizer = make_optimizer(model, OPTIM)
    lm_loss(model, torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)).backward()
    optimizer.step()
    par = Parallel("single", model, model, {}, {}, 0)
    names = par.param_names(optimizer)
    assert names[0] == "model.embed_tokens.weight" and len(names) == len(set(names)) == 20  # tied head once
    by_index = optimizer.state_dict()
    by_name = optimizer_state_by_name(by_index, names)
    assert set(by_name["state"]) == set(names)
    assert by_name["param_groups"][1]["params"][0] == names[len(by_index["param_groups"][0]["params"])]
    back = optimizer_state_by_index(by_name, names)
    assert back["param_groups"] == by_index["param_groups"]
    assert back["state"].keys() == by_index["state"].keys()
    assert all(back["state"][i]["exp_avg"] is by_index["state"][i]["exp_avg"] for i in back["state"])
