"""Saving and resuming a training run's state: the newest valid checkpoint in, a new one out.

Every rank calls these (they hold collectives); rank 0 alone picks, reads and writes the
checkpoint folder (trainforge.trainer.checkpoint).
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import safetensors
import torch
import torch.distributed as dist
import transformers

from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer import powersgd
from trainforge.trainer.amp import Precision
from trainforge.trainer.config import ConfigError, JobConfig
from trainforge.trainer.dataset import Dataset
from trainforge.trainer.distributed import Dist
from trainforge.trainer.errors import DivergedError
from trainforge.trainer.parallel import Parallel

log = logging.getLogger(__name__)

__all__ = ["has_own_checkpoint", "resume", "save"]


def has_own_checkpoint(cfg: JobConfig, d: Dist) -> bool:
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
    if par.powersgd is not None:
        _resume_powersgd(c, cfg, d, par, amp)
    rngs = c.trainer_state.get("rng", [])
    if c.trainer_state.get("world_size") == d.world_size and len(rngs) == d.world_size:
        ckpt.restore_rng_state(rngs[d.rank])
    else:
        log.warning("checkpoint world size %s != %d: RNG states not restored (data order is unaffected)",
                    c.trainer_state.get("world_size"), d.world_size)
    log.info("resuming from %s (step %d)", c.path, c.step)
    return c.step, int(c.trainer_state["tokens_seen"]), c.meta.get("metrics", {}), history


def _resume_powersgd(c: ckpt.Checkpoint, cfg: JobConfig, d: Dist, par: Parallel, amp: Precision) -> None:
    """Continue each rank's PowerSGD state from its file in ``c``, or start it afresh everywhere.

    Afresh (a warning, and an entry in meta.json's ``powersgd.restarts`` from the next
    checkpoint on) when the checkpoint's world size differs (error feedback is per rank and does
    not map onto other ranks), it holds no PowerSGD state, or a rank cannot use its file. All
    ranks decide together: one rank continuing while another starts afresh would run different
    collectives.
    """
    hook = par.powersgd
    saved = c.meta.get("powersgd") or {}
    hook.restarts = [dict(r) for r in saved.get("restarts") or []]
    state, why = None, ""
    if int(c.meta.get("world_size", -1)) != d.world_size:
        why = (f"the checkpoint was trained on world size {c.meta.get('world_size')}, this attempt runs "
               f"{d.world_size} ranks, and error feedback is per rank")
    elif not saved:
        why = "the checkpoint holds no PowerSGD state (written without gradient_compression powersgd)"
    else:
        try:
            state, why = powersgd.from_state_dict(hook.state, ckpt.load_rank_file(c.path, ckpt.powersgd_file(d.rank)),
                                                  d.device)
        except ckpt.CheckpointError as err:
            why = str(err)
    usable = torch.tensor([0 if state is None else 1], device=d.device)
    dist.all_reduce(usable)  # how many ranks can continue
    if state is not None and usable.item() != d.world_size:
        state, why = None, f"{d.world_size - usable.item()} other rank(s) could not use their PowerSGD state"
    if state is None:
        hook.restarts.append({"step": c.step, "reason": why})
        log.warning("PowerSGD state not restored from %s: %s; starting it afresh (vanilla all-reduce for this "
                    "attempt's first %d steps), so this run is not identical with an uninterrupted one; recorded in "
                    "meta.json powersgd.restarts", c.path, why, hook.state.start_powerSGD_iter)
        return
    hook.state = state
    log.info("PowerSGD state restored from %s (iteration %d, error feedback of %d buckets)", c.path, state.iter,
             len(state.error_dict))
    tokens = torch.zeros((cfg.optim.micro_batch_size, cfg.data.sequence_length), dtype=torch.long, device=d.device)
    powersgd.rebuild_buckets(par.module, hook, tokens, amp.autocast())


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
    rank_files: dict[str, dict] = {}
    if par.powersgd is not None:  # each rank's own state, written by rank 0 like the RNG states
        states = [None] * d.world_size
        dist.gather_object(powersgd.state_dict(par.powersgd.state), states if d.rank == 0 else None, dst=0)
        rank_files = {ckpt.powersgd_file(r): s for r, s in enumerate(states)} if d.rank == 0 else {}
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
        if par.powersgd is not None:
            meta["powersgd"] = {"files": list(rank_files), "iteration": par.powersgd.state.iter,
                                "restarts": par.powersgd.restarts}
        t0 = time.perf_counter()
        path = ckpt.write_checkpoint(cfg.checkpoint.dir, step, weights, optimizer_state, state, meta, rank_files)
        deleted = ckpt.apply_retention(cfg.checkpoint.dir, cfg.checkpoint.keep_last)
        log.info("checkpoint %s written in %.2fs (retention deleted %d)", path, time.perf_counter() - t0, len(deleted))
    if d.enabled:
        dist.barrier()
    return path


def _versions() -> dict[str, str]:
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "numpy": np.__version__}
