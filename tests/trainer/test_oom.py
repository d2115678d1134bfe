"""A GPU out of memory, handled: an injected ``torch.OutOfMemoryError`` in the trainer's own loop
(one rank, in this process) is exit 80 naming the rank, the step, the phase and the memory; with
``training.fault.on_oom: shrink_micro_batch`` the retry trains at half the micro-batch and twice
the accumulation, and its loss curve equals an unshrunk run's (fp32)."""

from __future__ import annotations

import json
import logging
import signal
from types import SimpleNamespace

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainforge.contract import FailureKind, failure_kind
from trainforge.ledger.tries import oom_figures, try_ended
from trainforge.oom_retry import oom_policy, retry_section
from trainforge.trainer import oom, optim, state
from trainforge.trainer import train as train_module
from trainforge.trainer.config import parse_job_config
from trainforge.trainer.train import main

MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
           "1.50 GiB is free. Including non-PyTorch memory, this process has 77.6 GiB memory in use.")
SHORT = {"optim": {"max_steps": 4, "warmup_steps": 1}, "checkpoint": {"interval_steps": 2, "keep_last": 2}}


@pytest.fixture
def run_main(tmp_path, job_file, monkeypatch):
    """``run_main(name, **sections) -> (exit code, result, {step: loss})``: ``main()`` here, one rank."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINFORGE_RESULT_FILE", str(tmp_path / "result.json"))
    handler, handlers, level = signal.getsignal(signal.SIGTERM), logging.root.handlers[:], logging.root.level
    real_should_step = optim.should_step

    def run(name="job.json", checkpoint_dir=None, retry=None, **sections):
        losses = {}

        def recording(step, loss, *rest):
            losses[step] = loss
            return real_should_step(step, loss, *rest)

        monkeypatch.setattr(train_module, "should_step", recording)
        job = job_file(name, checkpoint_dir, **{**SHORT, **sections})
        if retry is not None:  # what the train task renders for a try after an out of memory
            job.write_text(json.dumps({**json.loads(job.read_text()), "retry": retry}))
        code = main(["--config", str(job)])
        return code, json.loads((tmp_path / "result.json").read_text()), losses

    yield run
    signal.signal(signal.SIGTERM, handler)
    logging.root.handlers[:], logging.root.level = handlers, level
    state.abandon_pending_write()


def _oom_at(step_wanted: int, calls_per_step: int = 1):
    """A callable that raises the out of memory on its call during step ``step_wanted``."""
    calls = [0]

    def maybe_raise(*args, **kwargs):
        calls[0] += 1
        if calls[0] == (step_wanted - 1) * calls_per_step + 1:
            raise torch.OutOfMemoryError(MESSAGE)
    return maybe_raise


def _inject(monkeypatch, phase: str, step: int) -> None:
    if phase == "forward":  # inside micro_batch_loss: the model's forward
        real = train_module.lm_loss
        raise_at = _oom_at(step, calls_per_step=4)  # micro 2 of global 8: 4 micro-batches a step

        def lm_loss(*args, **kwargs):
            raise_at()
            return real(*args, **kwargs)
        monkeypatch.setattr(train_module, "lm_loss", lm_loss)
    elif phase == "backward":  # a hook on the loss: raised by autograd during the backward pass
        real, raise_at = train_module.lm_loss, _oom_at(step, calls_per_step=4)

        def lm_loss(*args, **kwargs):
            loss = real(*args, **kwargs)
            loss.register_hook(lambda grad: raise_at() or grad)
            return loss
        monkeypatch.setattr(train_module, "lm_loss", lm_loss)
    elif phase == "optimizer":  # a global optimizer step pre-hook, removed when the test ends
        raise_at = _oom_at(step)
        monkeypatch.setattr(torch.optim.Optimizer, "_test_oom_hook",
                            register_optimizer_step_pre_hook(lambda *args: raise_at()), raising=False)
    else:  # checkpoint staging: the loop's save() call
        def save(*args, **kwargs):
            raise torch.OutOfMemoryError(MESSAGE)
        monkeypatch.setattr(train_module, "save", save)


@pytest.mark.parametrize("phase, step", [("forward", 3), ("backward", 2), ("optimizer", 3),
                                         ("checkpoint staging", 2)])
def test_an_injected_out_of_memory_is_named_with_rank_step_phase_and_memory(run_main, monkeypatch, phase, step):
    _inject(monkeypatch, phase, step)
    try:
        code, result, _ = run_main()
    finally:
        if phase == "optimizer":
            torch.optim.Optimizer._test_oom_hook.remove()
    assert code == 80 and result["status"] == "out_of_memory", result
    assert result["message"].startswith(f"GPU out of memory on rank 0 (cpu) at step {step}, {phase}: tried to "
                                        f"allocate 2.00 GiB, 1.50 GiB free of 79.15 GiB; micro-batch 2 x "
                                        f"accumulation 4"), result["message"]
    assert result["oom"] == {"rank": 0, "step": step, "phase": phase, "requested_bytes": 2 * 2**30,
                             "free_bytes": int(1.5 * 2**30), "total_bytes": int(79.15 * 2**30),
                             "micro_batch_size": 2, "grad_accum_steps": 4}
    assert failure_kind(1, result) is FailureKind.PERMANENT  # torchrun's exit 1, the result decides


def test_by_default_the_failure_says_what_to_change_and_is_not_retried():
    event = {"status": "error", "message": "GPU out of memory on rank 1 ...", "handle": {"key": "j"},
             "failure": "permanent", "result": {"status": "out_of_memory",
                                                "oom": {"rank": 1, "micro_batch_size": 4, "grad_accum_steps": 2}}}
    failed = oom_policy(event, "fail")
    assert failed["failure"] == "permanent" and failed["oom"]["next_micro_batch_size"] is None
    assert failed["message"].endswith("training.fault.on_oom is 'fail': lower training.optimization."
                                      "micro_batch_size (now 4) or set training.fault.on_oom: shrink_micro_batch")
    at_floor = oom_policy({**event, "result": {"status": "out_of_memory", "oom": {"micro_batch_size": 1}}},
                          "shrink_micro_batch")
    assert at_floor["failure"] == "permanent" and "the micro-batch is 1, its floor" in at_floor["message"]
    other = {**event, "result": {"status": "error"}}
    assert oom_policy(other, "shrink_micro_batch") is other


def test_another_ranks_out_of_memory_is_its_result_and_rank_0_keeps_it(tmp_path, monkeypatch):
    result_file = tmp_path / "result.json"
    monkeypatch.setenv("TRAINFORGE_RESULT_FILE", str(result_file))
    cfg = SimpleNamespace(optim=SimpleNamespace(micro_batch_size=2), grad_accum_steps=lambda world: 2)
    d = SimpleNamespace(rank=1, world_size=2, device=torch.device("cpu"))
    with pytest.raises(oom.GpuOutOfMemoryError):
        with oom.named_oom(test_another_ranks_out_of_memory_is_its_result_and_rank_0_keeps_it, cfg, d):
            raise RuntimeError("a hook failed") from torch.OutOfMemoryError(MESSAGE)
    written = json.loads(result_file.read_text())
    assert written["status"] == "out_of_memory" and written["oom"]["rank"] == 1, written
    oom.write_result(str(result_file), {"status": "error", "exit_code": 143, "message": "received SIGTERM"})
    assert json.loads(result_file.read_text()) == written  # rank 0's SIGTERM is the consequence


def test_with_shrink_micro_batch_the_retry_runs_at_half_the_micro_batch_on_the_same_loss_curve(
        run_main, monkeypatch, tmp_path):
    real = train_module.lm_loss
    raise_at = _oom_at(3, calls_per_step=4)

    def lm_loss(*args, **kwargs):
        raise_at()
        return real(*args, **kwargs)
    monkeypatch.setattr(train_module, "lm_loss", lm_loss)
    code, result, before = run_main()  # micro 2 x accum 4; checkpoint at step 2, out of memory in step 3
    assert code == 80 and sorted(before) == [1, 2], result
    monkeypatch.setattr(train_module, "lm_loss", real)

    event = oom_policy({"status": "error", "message": result["message"], "handle": {"key": "j"},
                        "failure": failure_kind(1, result).value, "result": result}, "shrink_micro_batch")
    assert event["failure"] == "transient", event
    assert event["message"].endswith("the retry trains at micro-batch 1 x accumulation 8 (the same global "
                                     "batch), resuming the newest checkpoint")
    record = try_ended(None, 1, 0.0, event, 1.0)  # the try record the next try reads
    metrics, tags = oom_figures([record])
    assert metrics == {"out_of_memory/count": 1.0} and json.loads(tags["ledger/out_of_memory"]) == [
        {"try": 1, "rank": 0, "step": 3, "phase": "forward", "micro_batch_size": 2, "next_micro_batch_size": 1}]
    spec = SimpleNamespace(fault=SimpleNamespace(on_oom="shrink_micro_batch"),
                           optimization=SimpleNamespace(micro_batch_size=2))
    retry = retry_section(lambda: {"trainforge.ledger.try.1": json.dumps(record)}, 2, spec, logging.getLogger())
    assert retry == {"micro_batch_size": 1}

    code, result, after = run_main("retry.json", retry=retry)  # resumes step 2 at micro 1 x accum 8
    assert code == 0 and sorted(after) == [3, 4], result
    code, _, unshrunk = run_main("whole.json", tmp_path / "whole")
    assert code == 0
    for step in (1, 2, 3, 4):
        assert ({**before, **after})[step] == pytest.approx(unshrunk[step], rel=1e-5), (step, before, after, unshrunk)


def test_the_retry_section_shrinks_the_micro_batch_and_keeps_the_digest(valid_job):
    plain = parse_job_config(valid_job)
    shrunk = parse_job_config({**valid_job, "retry": {"micro_batch_size": 1}})
    assert (shrunk.optim.micro_batch_size, shrunk.grad_accum_steps(1)) == (1, 8)
    assert shrunk.digest() == plain.digest()
    with pytest.raises(Exception, match=r"retry.micro_batch_size=3: expected a divisor of optim.micro_batch_size=2"):
        parse_job_config({**valid_job, "retry": {"micro_batch_size": 3}})
