"""Train a small Llama-style LM on a prepared dataset: the program torchrun launches.

    # 2 processes on one machine (gloo on CPU, nccl when CUDA is available):
    torchrun --standalone --nproc-per-node=2 -m trainforge.trainer.train --config job.json
    # one process, no torchrun (debugging):
    python -m trainforge.trainer.train --config job.json

Environment: MLFLOW_TRACKING_URI + MLFLOW_RUN_ID (rank 0 logs params, step metrics and system/* metrics into that
existing run; unset URI = no MLflow), TRAINFORGE_RESULT_FILE (rank 0 writes result.json there on
every exit it survives to see), OMP_NUM_THREADS (torch threads per process; 1 when unset).

Exit codes (docs/contracts.md): 0 finished at max_steps, 78 bad config or dataset, 79 diverged
(non-finite loss or gradient norm, or non-finite weights at a checkpoint), anything else is a
crash the orchestrator retries; every attempt first resumes from the newest valid checkpoint.

One optimizer step: global_batch sequences = micro_batch x world x accum; each rank runs
``accum`` forward/backward passes (gradients reduced only on the last: DDP.no_sync, FSDP2
set_requires_gradient_sync), clips the global gradient norm, checks the loss is finite, then
steps AdamW. The pieces the job config's ``precision`` and ``framework`` choose live in
trainer/amp.py (autocast, fp16 loss scaling) and trainer/parallel.py (DDP or FSDP2, gradient
compression, activation checkpointing, checkpoint state under either).
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
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import safetensors
import torch
import torch.distributed as dist
import transformers

from trainforge.contract import EXIT_ERROR, EXIT_OK, RESULT_FILE_ENV, STATUS_ERROR, STATUS_SUCCESS
from trainforge.storage.files import atomic_write_json
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.amp import MIN_LOSS_SCALE, Precision
from trainforge.trainer.config import ConfigError, JobConfig, OptimConfig, load_job_config
from trainforge.trainer.data import BatchSampler, TokenStream, open_dataset
from trainforge.trainer.dataset import Dataset
from trainforge.trainer.distributed import Dist, setup_distributed, shut_down
from trainforge.trainer.errors import DivergedError, TerminatedError, TrainerError
from trainforge.trainer.model import build_model, llama_config, lm_loss, load_initial_weights
from trainforge.trainer.parallel import Parallel, parallelize
from trainforge.trainer.schedule import lr_at
from trainforge.trainer.tracking import MlflowTracker

log = logging.getLogger("trainforge.trainer.train")

__all__ = ["after_training_failure", "lr_at", "main", "make_optimizer", "should_step", "train"]


@dataclass
class Outcome:
    """What rank 0 reports in the result file; filled in as training goes."""

    final_step: int = 0
    tokens_seen: int = 0
    final_train_loss: float | None = None
    last_checkpoint: str | None = None


def make_optimizer(model: torch.nn.Module, o: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on 2-D+ parameters (matmuls, embeddings) only, not on norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=1e-8)


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


def _has_own_checkpoint(cfg: JobConfig, d: Dist) -> bool:
    """Whether ``checkpoint.dir`` holds a valid checkpoint (rank 0 decides for every rank)."""
    found = [ckpt.newest_valid(cfg.checkpoint.dir) is not None] if d.rank == 0 else [None]
    if d.enabled:
        dist.broadcast_object_list(found, src=0)
    return bool(found[0])


def resume(cfg: JobConfig, d: Dist, dataset: Dataset, par: Parallel, optimizer, amp: Precision
           ) -> tuple[int, int, dict, list[dict[str, int]]]:
    """Load the newest valid checkpoint, if any, into the model, ``optimizer`` and the fp16 scaler.

    Rank 0 picks the folder (`checkpoint.newest_valid`) and broadcasts it, so every rank loads
    the same step. Returns ``(step, tokens_seen, metrics at that step, world_size_history)``
    (`checkpoint.world_size_history`: this attempt's world size appended when it changed);
    ``(0, 0, {}, [{"from_step": 0, "world_size": W}])`` on a fresh start.

    Raises:
        ConfigError: the checkpoint was trained on another dataset or model shape, or on
            another world size with ``distributed.world_size_change`` "refuse".
        CheckpointError: the chosen checkpoint cannot be loaded.
    """
    chosen = [None]
    if d.rank == 0:
        newest = ckpt.newest_valid(cfg.checkpoint.dir)
        chosen = [str(newest) if newest else None]
    if d.enabled:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        log.info("no valid checkpoint under %s: starting from step 0", cfg.checkpoint.dir)
        return 0, 0, {}, ckpt.world_size_history(None, d.world_size)
    c = ckpt.load_checkpoint(chosen[0])
    saved_world = c.meta.get("world_size", c.trainer_state.get("world_size"))
    if saved_world is not None and int(saved_world) != d.world_size:
        if cfg.distributed.world_size_change == "refuse":
            raise ConfigError(f"checkpoint {c.path} was trained on world size {saved_world}, this attempt runs "
                              f"{d.world_size} ranks and distributed.world_size_change is 'refuse' "
                              f"(spec: training.fault.world_size_change); run on {saved_world} ranks, or set it "
                              f"to 'continue' to reshard")
        log.warning("checkpoint %s was trained on world size %s, this attempt runs %d ranks: resharding "
                    "(distributed.world_size_change=continue; recorded in world_size_history)",
                    c.path, saved_world, d.world_size)
    history = ckpt.world_size_history(c.meta, d.world_size)
    saved = c.meta.get("job_config", {})
    if c.meta.get("dataset_digest") != dataset.digest:
        raise ConfigError(f"checkpoint {c.path} was trained on dataset {c.meta.get('dataset_digest')}, "
                          f"data.dataset_dir has {dataset.digest}; use a new checkpoint.dir")
    saved_seq_len = saved.get("data", {}).get("sequence_length")
    if saved.get("model") != cfg.raw["model"] or saved_seq_len != cfg.data.sequence_length:
        raise ConfigError(f"checkpoint {c.path} has model {saved.get('model')} and sequence_length "
                          f"{saved_seq_len}; the job config asks for "
                          f"{cfg.raw['model']} / {cfg.data.sequence_length}; use a new checkpoint.dir")
    try:
        par.load_full_state(c.weights, c.optimizer, optimizer)
    except ValueError as err:
        raise ckpt.CheckpointError(f"{c.path}: {err}") from err
    if amp.scaler is not None and not amp.load_state_dict(c.trainer_state.get("grad_scaler")):
        log.warning("checkpoint %s has no fp16 loss-scaler state: starting from scale %g", c.path, amp.loss_scale())
    if cfg.framework.gradient_compression == "powersgd":
        log.warning("PowerSGD state (error feedback, warm-start factors, iteration count) is not checkpointed: "
                    "restarting it, so this run is not bit-identical with an uninterrupted one")
    rngs = c.trainer_state.get("rng", [])
    if c.trainer_state.get("world_size") == d.world_size and len(rngs) == d.world_size:
        ckpt.restore_rng_state(rngs[d.rank])
    else:
        log.warning("checkpoint world size %s != %d: RNG states not restored (data order is unaffected)",
                    c.trainer_state.get("world_size"), d.world_size)
    log.info("resuming from %s (step %d)", c.path, c.step)
    return c.step, int(c.trainer_state["tokens_seen"]), c.meta.get("metrics", {}), history


def save(cfg: JobConfig, d: Dist, dataset: Dataset, par: Parallel, optimizer, amp: Precision, step: int,
         tokens_seen: int, accum: int, metrics: dict, world_sizes: list[dict[str, int]] | None = None
         ) -> Path | None:
    """Write step ``step`` (rank 0) after every rank handed over its RNG state; returns the folder.

    Every rank must call it (finiteness check, RNG gather, FSDP's full-state gather).

    Raises:
        DivergedError: a weight is not finite (a diverged run never writes a checkpoint).
    """
    bad = torch.tensor([par.nonfinite_parameters()], device=d.device)
    if d.enabled:
        dist.all_reduce(bad)
    if bad.item():
        raise DivergedError(f"step {step}: {bad.item()} parameter tensors hold non-finite values "
                            f"(lr {metrics.get('learning_rate')}); no checkpoint written")
    rngs = [None] * d.world_size
    if d.enabled:
        dist.gather_object(ckpt.capture_rng_state(), rngs if d.rank == 0 else None, dst=0)
    else:
        rngs = [ckpt.capture_rng_state()]
    weights, optimizer_state = par.full_state(optimizer)  # a collective under FSDP; None on ranks > 0
    path = None
    if d.rank == 0:
        state = {"step": step, "tokens_seen": tokens_seen, "world_size": d.world_size, "scheduler": {"step": step},
                 "rng": rngs}
        if amp.scaler is not None:
            state["grad_scaler"] = amp.state_dict()
        meta = {"step": step, "tokens_seen": tokens_seen, "world_size": d.world_size,
                "world_size_history": world_sizes or ckpt.world_size_history(None, d.world_size),
                "grad_accum_steps": accum,
                "config_digest": cfg.digest(), "dataset_digest": dataset.digest,
                "dataset": {"vocab_size": dataset.vocab_size, "eos_id": dataset.eos_id, "eos_token": dataset.eos_token,
                            "tokenizer_sha256": dataset.tokenizer_sha256},
                "job_config": cfg.raw, "versions": _versions(), "metrics": metrics,
                "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        t0 = time.perf_counter()
        path = ckpt.write_checkpoint(cfg.checkpoint.dir, step, weights, optimizer_state, state, meta)
        deleted = ckpt.apply_retention(cfg.checkpoint.dir, cfg.checkpoint.keep_last)
        log.info("checkpoint %s written in %.2fs (retention deleted %d)", path, time.perf_counter() - t0, len(deleted))
    if d.enabled:
        dist.barrier()
    return path


def _versions() -> dict[str, str]:
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "numpy": np.__version__}


def train(cfg: JobConfig, d: Dist, out: Outcome) -> None:
    """Run (or finish) the training described by ``cfg``; ``out`` tracks progress for the result file."""
    o, T = cfg.optim, cfg.data.sequence_length
    accum = cfg.grad_accum_steps(d.world_size)  # ConfigError when the batch does not divide
    random.seed(o.seed)
    np.random.seed(o.seed % 2**32)
    torch.manual_seed(o.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's; FSDP2 relies on it)

    dataset = open_dataset(cfg.data.dataset_dir)
    sampler = BatchSampler(TokenStream(dataset, "train"), T, o.micro_batch_size, accum, d.world_size, o.seed)
    model = build_model(llama_config(cfg.model, dataset.vocab_size, dataset.eos_id, T)).to(d.device)
    n_params = sum(p.numel() for p in model.parameters())  # before sharding; tied weights counted once
    if cfg.init is not None and not _has_own_checkpoint(cfg, d):  # its own checkpoint wins on a retry
        load_initial_weights(model, cfg.init.checkpoint, dataset.tokenizer_path, dataset.tokenizer_sha256)
    par = parallelize(model, cfg, d)  # DDP or FSDP2 (+ compression hook, activation checkpointing)
    optimizer = make_optimizer(par.model, o)  # after sharding: FSDP2 replaces the parameters
    amp = Precision(cfg.precision, d.device, sharded=par.kind == "fsdp")
    step, tokens_seen, metrics, world_sizes = resume(cfg, d, dataset, par, optimizer, amp)
    out.final_step, out.tokens_seen, out.final_train_loss = step, tokens_seen, metrics.get("train_loss")
    if step and d.rank == 0:
        out.last_checkpoint = ckpt.join(cfg.checkpoint.dir, ckpt.step_dir_name(step))  # local path or s3:// URI
    par.model.train()
    tokens_per_step = o.global_batch_size * T

    tracker = MlflowTracker.from_env() if d.rank == 0 else None
    if tracker:
        tracker.skip_logged_steps(step)  # exactly once: a resumed attempt never re-logs a step
        flat = {f"{s}.{k}": v for s in ("data", "model", "optim", "checkpoint", "logging", "distributed")
                for k, v in cfg.raw[s].items()}
        flat |= {f"framework.{k}": v for k, v in dataclasses.asdict(cfg.framework).items()}  # resolved defaults
        tracker.log_params(flat | {"optim.lr_schedule": o.lr_schedule, "precision": cfg.precision,
                                   "world_size": d.world_size, "grad_accum_steps": accum,
                                   "num_parameters": n_params, "dataset_digest": dataset.digest,
                                   "config_digest": cfg.digest()})
        # Params keep the first attempt's world_size; the tag holds every change.
        tracker.set_tags({"trainforge.world_size_history": json.dumps(world_sizes, separators=(",", ":"))})
    log.info("model: %d parameters; %d steps of %d sequences x %d tokens (micro %d x world %d x accum %d); "
             "%s, %s, %s schedule", n_params, o.max_steps, o.global_batch_size, T, o.micro_batch_size,
             d.world_size, accum, par.kind, cfg.precision, o.lr_schedule)

    # system/* metrics of rank 0's machine while the steps run (trainforge.trainer.tracking)
    with tracker.system_metrics() if tracker else nullcontext():
        t_window, steps_in_window = time.perf_counter(), 0
        while step < o.max_steps:
            lr = lr_at(step, o)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=d.device)  # mean loss of this rank's micro-batches
            for a, (x, y) in enumerate(sampler.micro_batches(step, d.rank)):  # x, y: (micro_batch, T) int64
                x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
                with par.grad_sync(a == accum - 1):  # reduce across ranks on the last micro-batch only
                    with amp.autocast():
                        loss = lm_loss(par.module, x, y) / accum  # scalar, nats/token
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
            out.final_step, out.tokens_seen, out.final_train_loss = step, tokens_seen, loss_value
            metrics = {"train_loss": loss_value, "learning_rate": lr, "grad_norm": grad_norm}
            if not math.isfinite(grad_norm):  # a skipped fp16 step: keep inf out of meta.json and MLflow
                del metrics["grad_norm"]

            if d.rank == 0 and (step % cfg.logging.log_every_steps == 0 or step == o.max_steps):
                elapsed = time.perf_counter() - t_window
                metrics["tokens_per_s"] = steps_in_window * tokens_per_step / max(elapsed, 1e-9)
                log.info("step %d/%d | loss %.4f | lr %.3e | grad_norm %.3f | tok/s %.0f", step, o.max_steps,
                         loss_value, lr, grad_norm, metrics["tokens_per_s"])
                if tracker:
                    tracker.log_metrics(step, metrics)
                t_window, steps_in_window = time.perf_counter(), 0
            if step % cfg.checkpoint.interval_steps == 0 or step == o.max_steps:
                with sigterm_deferred():  # a checkpoint and its mention in the result file go together
                    path = save(cfg, d, dataset, par, optimizer, amp, step, tokens_seen, accum, metrics,
                                world_sizes)
                    if path is not None:
                        out.last_checkpoint = str(path)
                t_window, steps_in_window = time.perf_counter(), 0  # checkpoint time is not training throughput
    if step > o.max_steps:
        log.warning("resumed at step %d, past optim.max_steps=%d: nothing to train", step, o.max_steps)
    # Known trap: gloo can hang at exit when a DDP model outlives the process group.
    del par, model, optimizer


def _on_sigterm(signum, frame) -> None:
    raise TerminatedError("received SIGTERM (torchrun stopping the worker group, or the task being killed)")


@contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Hold SIGTERM back (blocked, not lost) for the duration of the block; it lands right after."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


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
    if rank == 0 and result_file:
        Path(result_file).unlink(missing_ok=True)  # a stale result must not speak for this attempt

    out = Outcome()
    cfg = None
    try:
        cfg = load_job_config(args.config)
        d = setup_distributed(cfg)
        train(cfg, d, out)
        code, status, message = EXIT_OK, STATUS_SUCCESS, f"finished at step {out.final_step}"
        consistent = True
    except (TrainerError, TerminatedError) as err:
        code, status, message = err.exit_code, err.status, str(err)
        # Config and divergence errors are raised identically on every rank: a clean shutdown is safe.
        consistent = isinstance(err, (ConfigError, DivergedError))
        log.error("%s (exit %d): %s", type(err).__name__, code, message)
    except BaseException as err:  # noqa: BLE001 - every exit path writes the result file
        code = 130 if isinstance(err, KeyboardInterrupt) else EXIT_ERROR
        status, message, consistent = STATUS_ERROR, f"{type(err).__name__}: {err}", False
        log.exception("training failed")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish reporting; torchrun SIGKILLs after its grace period
    result = {"status": status, "exit_code": code, "message": message, "final_step": out.final_step,
              "tokens_seen": out.tokens_seen, "final_train_loss": out.final_train_loss,
              "last_checkpoint": out.last_checkpoint}
    if rank == 0 and result_file:
        atomic_write_json(result_file, result)
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
    sys.exit(main())
