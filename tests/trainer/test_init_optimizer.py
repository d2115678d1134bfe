"""The model built on the meta device and initialised where it trains, fused AdamW, and the
recompilation watch: unit tests, in-process, on the CPU."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import LlamaForCausalLM

from trainforge.trainer.compile import RecompileWatch
from trainforge.trainer.config import ModelConfig, OptimConfig
from trainforge.trainer.model import build_model, llama_config
from trainforge.trainer.optim import fused_adamw_supported, make_optimizer

MODEL = ModelConfig(family="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=64, rope_theta=10000.0, dropout=0.0, tie_word_embeddings=True)
OPTIM = OptimConfig(max_steps=10, global_batch_size=4, micro_batch_size=2, learning_rate=1e-2,
                    min_learning_rate=1e-3, warmup_steps=0, weight_decay=0.1, beta1=0.9, beta2=0.95,
                    grad_clip=1.0, seed=7)


def _built(seed: int, tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = ModelConfig(**{**MODEL.__dict__, "tie_word_embeddings": tied})
    return build_model(llama_config(model, 300, 0, 16))


def test_the_same_seed_builds_the_same_weights_and_another_seed_others():
    a, b, c = _built(1), _built(1), _built(2)
    for (name, ta), tb, tc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(ta, tb), name
        if name.endswith("proj.weight"):
            assert not torch.equal(ta, tc), name


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_every_parameter_and_buffer_is_set_and_tied_weights_stay_tied(tied):
    model = _built(3, tied)
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # transformers' init: normal(0, initializer_range = 0.02)
            assert 0.01 < p.std().item() < 0.03, name
    # The rotary frequencies are buffers (not in a checkpoint): recomputed, equal to an eager build's.
    torch.manual_seed(3)
    reference = LlamaForCausalLM(llama_config(MODEL, 300, 0, 16))
    buffers = dict(model.named_buffers())
    assert set(buffers) == {n for n, _ in reference.named_buffers()} and buffers
    for name, ref in reference.named_buffers():
        assert torch.equal(buffers[name], ref), name


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 300, (2, 16), generator=g)
        logits = model(input_ids=x).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_fused_adamw_is_chosen_where_supported():
    model = _built(4)
    assert fused_adamw_supported(list(model.parameters()))  # torch >= 2.4 has the CPU kernel
    assert make_optimizer(model, OPTIM).defaults["fused"] is True
    assert not make_optimizer(model, OPTIM, fused=False).defaults["fused"]


@pytest.mark.parametrize("fused_first", [True, False], ids=["fused-to-foreach", "foreach-to-fused"])
def test_a_checkpoint_resumes_across_fused_and_unfused_adamw(fused_first):
    """Train 3 steps with one kind, hand model and optimizer state to the other kind, train 3 more:
    the weights equal those of 6 steps with the first kind (to fp32 rounding)."""
    straight = _built(5)
    opt = make_optimizer(straight, OPTIM, fused=fused_first)
    _train(straight, opt, 3, seed=0)
    weights = {k: v.clone() for k, v in straight.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())  # the live state changes in place as training goes on
    _train(straight, opt, 3, seed=1)

    resumed = _built(6)
    resumed.load_state_dict(weights)
    other = make_optimizer(resumed, OPTIM, fused=not fused_first)
    other.load_state_dict(state)
    _train(resumed, other, 3, seed=1)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    steps = {float(s["step"]) for s in other.state_dict()["state"].values()}
    assert steps == {6.0}


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2


def test_a_recompilation_after_warm_up_is_warned_about_with_its_cause(caplog):
    block = _Block()
    block.compile(dynamic=False)
    with caplog.at_level(logging.INFO, logger="trainforge.trainer.compile"), RecompileWatch() as watch:
        watch.step = 1
        block(torch.randn(2, 8))
        watch.step = 3
        block(torch.randn(2, 8))  # same shape: no recompilation
        assert watch.recompiles == 0
        block(torch.randn(5, 8))  # a new batch size after warm-up
    assert watch.recompiles == 1 and watch.after_warmup == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "during step 3" in warned[0] and "size mismatch" in warned[0], warned


def test_sigterm_from_another_thread_is_held_until_the_deferred_block_ends():
    """The handler runs on the main thread whichever thread the signal reaches: the block holds it
    with a flag, and raises it as the block ends."""
    import os
    import signal
    import threading

    from trainforge.trainer.errors import TerminatedError
    from trainforge.trainer.train import _on_sigterm, sigterm_deferred

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        reached_end = False
        with pytest.raises(TerminatedError, match="received SIGTERM"):
            with sigterm_deferred():
                sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM))
                sender.start()
                sender.join()
                for _ in range(1000):  # bytecodes: the handler has run by now, and held it
                    pass
                reached_end = True
        assert reached_end
        with pytest.raises(TerminatedError):  # outside a block it lands at once
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize(("device_type", "variable"), [("cuda", "CC"), ("cpu", "CXX")])
def test_a_missing_compiler_is_named(monkeypatch, device_type, variable):
    from trainforge.trainer.compile import missing_compiler

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert f"{variable} is unset" in missing_compiler(device_type)
    monkeypatch.setenv(variable, "/nonexistent/cc")
    assert f"{variable}='/nonexistent/cc' is not an executable" in missing_compiler(device_type)


@pytest.mark.parametrize("setting", ["auto", True])
def test_without_a_compiler_auto_trains_eager_and_true_is_a_config_error(monkeypatch, tmp_path, setting, caplog,
                                                                        tools):
    """framework.compile on a machine without the compiler torch.compile needs."""
    from trainforge.trainer import parallel
    from trainforge.trainer.config import ConfigError, parse_job_config
    from trainforge.trainer.distributed import Dist

    job = tools.make_job(tmp_path / "d", tmp_path / "c")
    job["framework"] = {"compile": setting}
    cfg = parse_job_config(job)
    monkeypatch.setattr(parallel, "missing_compiler", lambda device_type: "a C++ compiler (test)")
    model = _built(8)
    d = Dist(False, 0, 0, 1, torch.device("cpu"))
    if setting is True:
        with pytest.raises(ConfigError, match="framework.compile=true needs a C\\+\\+ compiler"):
            parallel.parallelize(model, cfg, d)
    else:  # auto is off on the CPU anyway: pretend a CUDA device type for the decision
        monkeypatch.setattr(type(cfg.framework), "compile_on", lambda self, device_type: True)
        with caplog.at_level(logging.WARNING, logger="trainforge.trainer.parallel"):
            par = parallel.parallelize(model, cfg, d)
        assert not par.compiled and "training eager" in caplog.text
