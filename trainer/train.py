"""Train a causal LM (the spec's small Llama, or open weights) on a prepared dataset: what torchrun runs.

    # 2 processes on one machine (gloo on CPU, nccl when CUDA is available):
    torchrun --standalone --nproc-per-node=2 -m trainforge.trainer.train --config job.json
    # one process, no torchrun (debugging):
    python -m trainforge.trainer.train --config job.json

Environment: MLFLOW_TRACKING_URI + MLFLOW_RUN_ID (rank 0 logs params, step and system/* metrics into that
run; unset URI = no MLflow), TRAINFORGE_RESULT_FILE (rank 0 writes result.json there on
every exit it survives to see), OMP_NUM_THREADS (torch threads per process; 1 when unset),
TRAINFORGE_JOB_DIR (rank 0 writes its run-ledger records under ``ledger/``: trainer/goodput.py).

Exit codes (docs/contracts.md): 0 finished at max_steps, 78 bad config, dataset, environment (trainer/env_check.py)
or model (the check before step 1: trainer/model_check.py), 79 diverged (non-finite loss or gradient norm, or non-finite weights at a
checkpoint), 80 GPU out of memory (trainer/oom.py), anything else is a crash the orchestrator retries;
every attempt first resumes from the newest valid checkpoint.

One optimizer step: global_batch sequences = micro_batch x world x accum; each rank runs
``accum`` forward/backward passes (gradients reduced only on the last: DDP.no_sync, FSDP2
set_requires_gradient_sync), clips the global gradient norm, checks the loss is finite, then
steps AdamW. The loss is the mean over the global batch's targets (an examples dataset's are
counted first: docs/trainer.md, "Loss normalisation"). The pieces the job config's ``precision``
and ``framework`` choose live in trainer/amp.py (autocast, fp16 loss scaling) and
trainer/parallel.py (DDP or FSDP2, gradient compression, activation checkpointing, checkpoint
state under either).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from trainforge.trainer.verdict import end_if_decided, recorded  # first: a restart after exit 78,
end_if_decided(__name__)  # 79 or 80 of this run exits here with it, before torch loads (trainer/verdict.py)
import numpy as np
import torch
import torch.distributed as dist

from trainforge.trainer.env_check import refuse_conflicts
from trainforge.trainer.startup import import_llama, process_started_at

if __name__ == "__main__":  # the program only, not its importers: trainer/startup.py
    import_llama(module="transformers")  # its root first, with the unused packages hidden, for the check
    refuse_conflicts(sys.argv[1:])  # transformers blind to torch, a torch feature the job needs: exit 78
    import_llama()

from trainforge.contract import (COMPILE_MODE_TAG, EXIT_ERROR, EXIT_OK, JOB_DIR_ENV, RESULT_FILE_ENV,
                                 STATUS_ERROR, STATUS_SUCCESS)
from trainforge.storage.files import atomic_write_json
from trainforge.trainer import checkpoint as ckpt, oom
from trainforge.trainer.amp import Precision
from trainforge.trainer.compile import RecompileWatch
from trainforge.trainer.config import ConfigError, JobConfig, load_job_config
from trainforge.trainer.data import make_sampler, open_dataset
from trainforge.trainer.distributed import Dist, setup_distributed, shut_down
from trainforge.trainer.energy import EnergyMeter
from trainforge.trainer.errors import DivergedError, GpuOutOfMemoryError, TerminatedError, TrainerError
from trainforge.trainer.float8 import ARTIFACT as float8_artifact, divergence_note
from trainforge.trainer.goodput import AttemptClock, flops_per_token
from trainforge.trainer.gpus import JobGpus, torch_cuda_uuids
from trainforge.trainer.loss import IGNORE_INDEX
from trainforge.trainer.model import attention_shape, lm_loss
from trainforge.trainer.model_check import check_model
from trainforge.trainer.optim import make_optimizer, should_step
from trainforge.trainer.rank_record import RankRecord
from trainforge.trainer.restarts import begin_attempt
from trainforge.trainer.schedule import lr_at
from trainforge.trainer.start import start_model
from trainforge.trainer.state import close_pending_write, finish_pending_write, reserve_staging, resume, save
from trainforge.trainer.tracking import MlflowTracker

log = logging.getLogger("trainforge.trainer.train")
__all__ = ["after_training_failure", "lr_at", "main", "micro_batch_loss", "train"]


@dataclass
class Outcome:
    """What rank 0 reports in the result file; filled in as training goes."""

    final_step: int = 0
    tokens_seen: int = 0
    final_train_loss: float | None = None
    last_checkpoint: str | None = None
    record: RankRecord | None = None  # every rank's own: each step renews it as a sign of life


def train(cfg: JobConfig, d: Dist, out: Outcome) -> None:
    """Run (or finish) the training described by ``cfg``; ``out`` tracks progress for the result file."""
    o, T = cfg.optim, cfg.data.sequence_length
    accum = cfg.grad_accum_steps(d.world_size)  # ConfigError when the batch does not divide
    random.seed(o.seed), np.random.seed(o.seed % 2**32)
    torch.manual_seed(o.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's; FSDP2 relies on it)

    # Startup phases, logged before the first step; imports and the process group come before train().
    since_start_s, marks = time.time() - process_started_at(), [("setup", time.perf_counter())]
    dataset = open_dataset(cfg.data.dataset_dir)
    marks.append(("dataset", time.perf_counter()))
    sampler = make_sampler(dataset, T, o.micro_batch_size, accum, d.world_size, o.seed, cfg.data.packing)
    examples = dataset.examples is not None  # loss per loss token of the global batch (_loss_tokens)
    started = start_model(cfg, d, dataset)  # built or loaded, initial weights, DDP or FSDP2
    model, par, n_params, at_start = started.model, started.par, started.n_params, started.at_start
    marks.append(("model and parallelize", time.perf_counter()))
    # After sharding: FSDP2 replaces the parameters. The fused kernel cannot take the (1,) overflow
    # flag of FSDP's ShardedGradScaler (torch 2.13): fp16 under FSDP steps with foreach AdamW.
    optimizer = make_optimizer(par.model, o, fused=False if par.kind == "fsdp" and cfg.precision == "fp16" else None)
    amp = Precision(cfg.precision, d.device, sharded=par.kind == "fsdp")
    marks.append(("optimizer", time.perf_counter()))
    t_restore = time.perf_counter()
    step, tokens_seen, metrics, world_sizes = resume(cfg, d, dataset, par, optimizer, amp)
    restore_s = time.perf_counter() - t_restore
    marks.append(("restore", time.perf_counter()))
    check_model(par.model, d)  # whole, finite, tied, the config's rotary frequencies: else exit 78, on every rank
    marks.append(("check", time.perf_counter()))
    out.final_step, out.tokens_seen, out.final_train_loss = step, tokens_seen, metrics.get("train_loss")
    if step and d.rank == 0:
        out.last_checkpoint = ckpt.join(cfg.checkpoint.dir, ckpt.step_dir_name(step))  # local path or s3:// URI
    par.model.train()
    tokens_per_step = o.global_batch_size * T

    tracker = MlflowTracker.from_env() if d.rank == 0 else None  # gpus: the job's own on rank 0's machine
    gpus = (JobGpus.open(cuda_uuids=torch_cuda_uuids()) if d.device.type == "cuda" else JobGpus.none()) \
        if d.rank == 0 else None  # each local rank's device by torch's UUID for it
    clock = _attempt_clock(cfg, d, model, n_params, tokens_per_step, gpus, par.compiled) if d.rank == 0 else None
    if clock:  # steps up to the newest one the run holds are trained again: wasted progress
        reached = tracker.skip_logged_steps(step) if tracker else step  # exactly once: never re-logged
        clock.restored(restore_s, step, reached)
    if tracker:
        flat = {f"{s}.{k}": v for s in ("data", "model", "optim", "checkpoint", "logging", "distributed",
                                        "pretrained") if s in cfg.raw for k, v in cfg.raw[s].items()}
        flat |= {f"framework.{k}": v for k, v in dataclasses.asdict(cfg.framework).items()}  # resolved defaults
        tracker.log_params(flat | {"optim.lr_schedule": o.lr_schedule, "precision": cfg.precision,
                                   "world_size": d.world_size, "grad_accum_steps": accum,
                                   "num_parameters": n_params, "dataset_digest": dataset.digest,
                                   "config_digest": cfg.digest()})
        tracker.log_at_start(at_start)  # {} without pretrained weights: nothing logged
        if started.float8_report:  # precision fp8: each linear converted or kept, and why
            tracker.log_text(started.float8_report, float8_artifact)
        tracker.set_tags({  # params keep the first attempt's world_size; the tag holds every change
            "trainforge.world_size_history": json.dumps(world_sizes, separators=(",", ":")),
            COMPILE_MODE_TAG: "compiled" if par.compiled else "eager"})  # what tokens_per_s measures
    log.info("model: %d parameters; %d steps of %d sequences x %d tokens (micro %d x world %d x accum %d); "
             "%s, %s, %s schedule, %s AdamW", n_params, o.max_steps, o.global_batch_size, T, o.micro_batch_size,
             d.world_size, accum, par.kind, cfg.precision, o.lr_schedule,
             "fused" if optimizer.defaults.get("fused") else "foreach")
    log.info("startup: %.1fs from process start to train() (imports, process group), then %s", since_start_s,
             ", ".join(f"{name} {t - prev:.1f}s" for (_, prev), (name, t) in zip(marks, marks[1:])))

    # Pin the saves' host buffers on a thread while the first step compiles (trainer/state.py).
    reserve_staging(d, par, optimizer, cfg.checkpoint.max_host_bytes)
    # system/* metrics of rank 0's machine while the steps run (trainforge.trainer.tracking)
    with (tracker.system_metrics(gpus=gpus) if tracker else nullcontext(), oom.named_oom(train, cfg, d),
          RecompileWatch(cfg.framework.compile_fallback) if par.compiled else nullcontext() as watch):
        t_window, steps_in_window = time.perf_counter(), 0
        if clock:
            clock.loop_started()
        while step < o.max_steps:
            if clock:
                clock.step_started()
            if watch:
                watch.begin_step(step + 1)  # CompileLimitError: a limit hit under compile_fallback=error
            lr = lr_at(step, o)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=d.device)  # this rank's share of the step's loss x world
            batches = sampler.micro_batches(step, d.rank)
            loss_tokens = _loss_tokens(batches, d) if examples else tokens_per_step  # N, the global batch's
            for a, batch in enumerate(clock.batches(batches) if clock else batches):  # x, y[, positions]: (m, T) int64
                if d.device.type == "cuda":  # pinned: the copy does not wait for the GPU to drain
                    batch = tuple(t.pin_memory() for t in batch)
                x, y, *positions = (t.to(d.device, non_blocking=True) for t in batch)
                with par.grad_sync(a == accum - 1):  # reduce across ranks on the last micro-batch only
                    with amp.autocast():  # scalar: this micro-batch's share of the step's mean, nats/token
                        loss = micro_batch_loss(par.module, x, y, accum, loss_tokens if examples else None,
                                                d.world_size, *positions)
                    amp.backward(loss)
                loss_sum += loss.detach()
            amp.unscale(optimizer)  # fp16: true gradients before clipping
            max_norm = o.grad_clip if o.grad_clip > 0 else float("inf")
            grad_norm = par.clip_grad_norm(max_norm)  # before clipping
            if d.enabled:
                dist.all_reduce(loss_sum)  # gloo has no AVG: sum, then divide
                loss_sum /= d.world_size
            loss_value = loss_sum.item()
            scale = amp.loss_scale()
            if not should_step(step + 1, loss_value, grad_norm, lr, scale) and d.rank == 0:
                log.warning("step %d: fp16 gradient overflow (grad norm %s): optimizer step skipped, loss scale %g "
                            "halved", step + 1, grad_norm, scale)
            amp.step(optimizer)  # skipped by the scaler after an overflow
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            steps_in_window += 1
            if clock:
                clock.step_done(step, watch.take_seconds() if watch else 0.0)  # compiling: its own bucket
                clock.compiled = watch.mode if watch else clock.compiled
            out.final_step, out.tokens_seen, out.final_train_loss = step, tokens_seen, loss_value
            if out.record is not None:  # ranks > 0 print nothing: their node's last sign of life
                out.record.alive()
            metrics = {"train_loss": loss_value, "learning_rate": lr, "grad_norm": grad_norm,
                       "loss_tokens": loss_tokens}  # targets of this step's loss (padded and prompt ones not)
            if not math.isfinite(grad_norm):  # a skipped fp16 step: keep inf out of meta.json and MLflow
                del metrics["grad_norm"]

            if d.rank == 0 and (step % cfg.logging.log_every_steps == 0 or step == o.max_steps):
                elapsed = time.perf_counter() - t_window
                metrics["tokens_per_s"] = steps_in_window * tokens_per_step / max(elapsed, 1e-9)
                log.info("step %d/%d | loss %.4f | lr %.3e | grad_norm %.3f | tok/s %.0f | loss_tokens %d", step,
                         o.max_steps, loss_value, lr, grad_norm, metrics["tokens_per_s"], loss_tokens)
                ledger_tags = clock.snapshot()
                if tracker:  # compile/*: this attempt's so far; the compile/mode tag: how the steps ran
                    tracker.log_metrics(step, metrics | (watch.metrics() if watch else {}),
                                        tags=ledger_tags | (watch.tags() if watch else {}))
                t_window, steps_in_window = time.perf_counter(), 0
            elif clock and clock.flush_due():  # a SIGKILL loses at most a few seconds of the record
                clock.flush(tracker)
            if step % cfg.checkpoint.interval_steps == 0 or step == o.max_steps:
                t_save = time.perf_counter()
                with sigterm_deferred():  # the blocking part: the write goes on in the background
                    save(cfg, d, dataset, par, optimizer, amp, step, tokens_seen, accum, metrics, world_sizes,
                         outcome=out, clock=clock)  # out.last_checkpoint: set once the checkpoint is complete
                if clock:
                    clock.flush(tracker, saved_s=time.perf_counter() - t_save)
                t_window, steps_in_window = time.perf_counter(), 0  # checkpoint time is not training throughput
        if clock:
            clock.loop_ended()
    if step > o.max_steps:
        log.warning("resumed at step %d, past optim.max_steps=%d: nothing to train", step, o.max_steps)
    if watch:
        log.info("%s", watch.summary())
    if d.device.type == "cuda":
        log.info("peak CUDA memory %.2f GiB allocated, %.2f GiB reserved", torch.cuda.max_memory_allocated(d.device) / 2**30,
                 torch.cuda.max_memory_reserved(d.device) / 2**30)
    if clock:
        ledger_tags = clock.snapshot(final=True)
        if tracker:
            tracker.set_tags(ledger_tags)
    # Known trap: gloo can hang at exit when a DDP model outlives the process group.
    del par, model, optimizer


def micro_batch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, accum: int, loss_tokens: int | None,
                     world_size: int, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The loss one micro-batch backpropagates, so that the gradients summed over micro-batches
    and averaged over ranks (DDP, FSDP2) are those of the mean over the global batch's targets.

    Args:
        x, y: (m, T) int64 (`IGNORE_INDEX` targets left out); position_ids: (m, T) of packed rows, or None.
        loss_tokens: N, the targets of the whole global batch (examples datasets): the summed
            nats / N x ``world_size`` (0 when N is 0). None (a document stream, where every
            micro-batch has m x T targets): the micro-batch's mean / ``accum``, the same mean.
    Returns:
        scalar float32 tensor.
    """
    if loss_tokens is None:
        return lm_loss(model, x, y, position_ids=position_ids) / accum
    return lm_loss(model, x, y, reduction="sum", position_ids=position_ids) / (max(loss_tokens, 1) / world_size)


def _loss_tokens(batches: list[tuple[torch.Tensor, ...]], d: Dist) -> int:
    """N: the targets (not `IGNORE_INDEX`: ``batch[1]``, padded or packed) of this step's micro-batches
    on every rank, counted before the first forward so that each micro-batch's backward can divide by it."""
    count = torch.tensor(sum(int((batch[1] != IGNORE_INDEX).sum()) for batch in batches), device=d.device)
    if d.enabled:
        dist.all_reduce(count)
    return int(count.item())


def _attempt_clock(cfg: JobConfig, d: Dist, model: torch.nn.Module, n_params: int,
                   tokens_per_step: int, gpus: JobGpus, compiled: bool) -> AttemptClock:
    """Rank 0's ledger clock of this attempt, with the energy counters of its machine and of the
    job's ``gpus`` on it."""
    embedding = model.get_input_embeddings().weight.numel()
    # LoRA: the adapters run too, and only they get weight gradients (n_params: the base alone).
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad) if cfg.peft is not None else None
    fpt = flops_per_token(n_params + (adapters or 0) - embedding, *attention_shape(model.config),
                          cfg.data.sequence_length, trainable_non_embedding=adapters)
    cuda = d.device.type == "cuda"
    return AttemptClock(world_size=d.world_size, tokens_per_step=tokens_per_step, flops_per_token=fpt,
                        device=torch.cuda.get_device_name(d.device) if cuda else "cpu",
                        energy=EnergyMeter.open(gpus if cuda else None),
                        job_dir=os.environ.get(JOB_DIR_ENV), compiled="compiled" if compiled else "eager")


_SIGTERM_MESSAGE = "received SIGTERM (torchrun stopping the worker group, or the task being killed)"
# Inside `sigterm_deferred`: [deferring, a SIGTERM arrived meanwhile].
_deferred = [False, False]


def _on_sigterm(signum, frame) -> None:
    if _deferred[0]:
        _deferred[1] = True  # raised when the deferred block ends
        return
    raise TerminatedError(_SIGTERM_MESSAGE)


@contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Hold SIGTERM back for the duration of the block (not lost: it is raised as the block ends).

    A flag, not a signal mask: the handler runs on the main thread whichever thread the kernel
    delivered the signal to (NCCL's, gloo's, the checkpoint writer's), so masking the main thread
    alone would not hold it.
    """
    _deferred[:] = [True, False]
    try:
        yield
    except BaseException:
        _deferred[:] = [False, False]  # the block's own failure goes on
        raise
    arrived = _deferred[1]
    _deferred[:] = [False, False]
    if arrived:
        raise TerminatedError(_SIGTERM_MESSAGE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainforge.trainer.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="path of the job config JSON (trainforge.job/v1)")
    args = parser.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING, force=True,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "mlflow", "alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or 1)))
    signal.signal(signal.SIGTERM, _on_sigterm)
    result_file = os.environ.get(RESULT_FILE_ENV)
    cfg, out = None, Outcome(record=(record := RankRecord()))  # how this rank ends, for the failure's message
    try:
        cfg = load_job_config(args.config)
        d = setup_distributed(cfg)
        attempt = begin_attempt(d.enabled, d.rank, d.device, record)  # one restart budget for the whole job
        if attempt.over_budget:  # the attempt before spent it: its result and records name the failure
            shut_down(True, attempt.exit_code, cfg.distributed.collective_timeout_s)
            return attempt.exit_code
        train(cfg, d, out)
        code, status, message = EXIT_OK, STATUS_SUCCESS, f"finished at step {out.final_step}"
        consistent = True
    except (TrainerError, TerminatedError) as err:
        code, status, message = err.exit_code, err.status, str(err) + divergence_note(err, cfg)  # fp8: says so
        # Config and divergence errors are raised identically on every rank: a clean shutdown is safe.
        consistent = isinstance(err, (ConfigError, DivergedError))
        log.error("%s (exit %d): %s", type(err).__name__, code, message)
        record.ended(err, code, out.final_step + 1)
        if consistent or isinstance(err, GpuOutOfMemoryError):  # this process is sound: rank 0's writer finishes
            finish_pending_write()  # the checkpoint before the failure completes and is reported
    except BaseException as err:  # noqa: BLE001 - every exit path writes the result file
        code = 130 if isinstance(err, KeyboardInterrupt) else EXIT_ERROR
        status, message, consistent = STATUS_ERROR, f"{type(err).__name__}: {err}", False
        log.exception("training failed")
        record.ended(err, code, out.final_step + 1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish reporting; torchrun SIGKILLs after its grace period
    if not consistent:
        close_pending_write()  # a manifest being published is finished and reported; none after the result
    result = {"status": status, "exit_code": code, "message": message, "final_step": out.final_step,
              "tokens_seen": out.tokens_seen, "final_train_loss": out.final_train_loss,
              "last_checkpoint": out.last_checkpoint}
    if rank == 0 and result_file:
        oom.write_result(result_file, result)  # an out of memory's record, or another rank's out of memory
    failure = shut_down(consistent, code, cfg.distributed.collective_timeout_s if cfg else 60.0)
    if failure is not None and code == EXIT_OK:
        result = after_training_failure(result, failure)
        code = result["exit_code"]
        log.error("%s", result["message"])
        if rank == 0 and result_file:
            atomic_write_json(result_file, result)
    return code  # SIGTERM stays ignored: exiting now is what torchrun asks for anyway


def after_training_failure(result: dict, failure: str) -> dict:
    """The result of a training that finished (``result`` says success) but whose ranks did not
    all leave: status ``error``, exit 1 (the job fails: transient), ``phase: after_training``,
    and a message that says so and that the final checkpoint is complete (it was written and
    verified before the failure), e.g. "post-training collective timeout on rank 1; the final
    checkpoint at step 40 is complete". The orchestrator's ``training.fault.post_training_failure``
    decides what the retry does (docs/faults.md).

    Args:
        failure: what the final barrier reported (`trainforge.trainer.distributed.barrier_failure`).
    """
    checkpoint = (f"the final checkpoint at step {result['final_step']} is complete ({result['last_checkpoint']})"
                  if result.get("last_checkpoint") else f"training finished at step {result['final_step']}")
    return {**result, "status": STATUS_ERROR, "exit_code": EXIT_ERROR, "phase": "after_training",
            "message": f"post-training {failure}; {checkpoint}"}


if __name__ == "__main__":
    sys.exit(recorded(main()))  # exit 78, 79 or 80: torchrun's restarts end at once (trainer/verdict.py)
