"""Saving and resuming a training run's state: the newest valid checkpoint in, a new one out.

Every rank calls these (they hold collectives); rank 0 alone picks, reads and writes the
checkpoint folder (trainforge.trainer.checkpoint), writing in the background
(trainforge.trainer.checkpoint_writer) while training goes on.
"""

from __future__ import annotations

import copy
import itertools
import logging
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import numpy as np
import safetensors
import torch
import torch.distributed as dist
import transformers

from trainforge.storage import Location
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer import host_memory, powersgd
from trainforge.trainer.adapters import adapter_base_sha256, check_adapter_base
from trainforge.trainer.amp import Precision
from trainforge.trainer.checkpoint_writer import CheckpointWriter, WriteResult, storage_addresses
from trainforge.trainer.config import ConfigError, JobConfig
from trainforge.trainer.dataset import Dataset
from trainforge.trainer.distributed import Dist
from trainforge.trainer.errors import DivergedError
from trainforge.trainer.goodput import AttemptClock
from trainforge.trainer.parallel import Parallel

log = logging.getLogger(__name__)

__all__ = ["abandon_pending_write", "has_own_checkpoint", "reserve_staging", "resume", "save"]

_writer: CheckpointWriter | None = None  # rank 0's, from its first save to the final one


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
    abandon_pending_write()
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
    if saved.get("peft") != cfg.raw.get("peft"):
        def what(peft: Any) -> str:
            return f"LoRA adapters {peft}" if peft else "full weights"
        raise ConfigError(f"checkpoint {c.path} holds {what(saved.get('peft'))}; the job config asks for "
                          f"{what(cfg.raw.get('peft'))} (training.peft); use a new checkpoint.dir")
    if cfg.peft is not None:
        check_adapter_base(c.path, c.meta, cfg)
    if bool(saved.get("data", {}).get("packing")) != bool(cfg.raw["data"].get("packing")):
        raise ConfigError(f"checkpoint {c.path} was trained with data.packing "
                          f"{bool(saved.get('data', {}).get('packing'))}, the job config asks for "
                          f"{bool(cfg.raw['data'].get('packing'))}: a step's batch differs between the two; use a "
                          "new checkpoint.dir")
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
         tokens_seen: int, accum: int, metrics: dict, world_sizes: list[dict[str, int]] | None = None, *,
         outcome: Any = None, clock: AttemptClock | None = None) -> Location | None:
    """Checkpoint step ``step``: blocks while the state is copied to host memory, then rank 0
    writes it in the background (trainforge.trainer.checkpoint_writer); returns its folder (rank 0).

    Every rank must call it (finiteness check, RNG gather, FSDP's full-state gather, and the
    barrier after staging). Rank 0 first waits for its previous write (its staging buffers are
    reused; the wait is blocking save time). The final save (``step >= optim.max_steps``) is
    awaited: it returns once the checkpoint is complete. On rank 0, ``outcome.last_checkpoint``
    is set once a checkpoint is complete and ``clock.saved_in_background`` gets each write's seconds.

    Raises:
        DivergedError: a weight is not finite (a diverged run never writes a checkpoint).
        CheckpointError: rank 0's previous write failed (raised on every rank), or the final one.
    """
    global _writer
    t0 = time.perf_counter()
    if d.rank == 0 and _writer is None:
        _writer = CheckpointWriter()
    previous = _writer.wait() if d.rank == 0 else None
    waited_s = time.perf_counter() - t0
    failed = previous.step if previous is not None and previous.error is not None else 0
    flags = torch.tensor([par.nonfinite_parameters(), failed], device=d.device)
    if d.enabled:
        dist.all_reduce(flags)  # rank 0 alone adds a failed step
    bad, failed = (int(x) for x in flags.tolist())
    if bad:
        raise DivergedError(f"step {step}: {bad} parameter tensors hold non-finite values "
                            f"(lr {metrics.get('learning_rate')}); no checkpoint written")
    if failed:
        _raise_failed(d, failed, previous)
    rngs = [None] * d.world_size
    if d.enabled:
        dist.gather_object(ckpt.capture_rng_state(), rngs if d.rank == 0 else None, dst=0)
    else:
        rngs = [ckpt.capture_rng_state()]
    weights, optimizer_state = _state_to_stage(par, optimizer)  # a collective under FSDP; None on ranks > 0
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
        if par.adapters_only:  # the base the adapters belong to: refused on another one
            meta["adapter"] = {"method": "lora", "base_sha256": adapter_base_sha256(cfg)}
        t_stage = time.perf_counter()
        # FSDP's gathered full state is a private CPU copy already: only what aliases live state is copied.
        shared = _live_storages(par, optimizer) if par.kind == "fsdp" else None
        tree = {"weights": weights, "optimizer": optimizer_state, "state": state, "rank_files": rank_files}
        mode = host_memory.decide(_writer, cfg.checkpoint.max_host_bytes, tree, shared, clock, step)
        staged = host_memory.unstaged(tree) if mode == "synchronous" else _writer.stage(tree, shared)
        del weights, optimizer_state, tree
        path = _writer.submit(cfg.checkpoint.dir, step, staged["weights"], staged["optimizer"], staged["state"],
                              copy.deepcopy(meta), staged["rank_files"], cfg.checkpoint.keep_last,
                              on_written=_on_written(outcome), on_ended=_on_ended(clock))
        if mode == "synchronous":  # the write reads the live state: training waits for it
            _writer.join()
        staged_s = time.perf_counter() - t_stage
    final = step >= cfg.optim.max_steps
    if final:
        _await_final(d)
    elif d.enabled:
        dist.barrier()  # every rank trains on once rank 0 holds its copy
    if d.rank == 0:
        host_memory.note_phase(0, f"training after checkpoint step {step}")
        blocked_s = time.perf_counter() - t0
        if final:
            log.info("checkpoint %s written: training blocked %.2fs (the final save is awaited)", path, blocked_s)
        elif mode == "synchronous":
            log.info("checkpoint %s written synchronously: training blocked %.2fs (%.2fs waiting for the write "
                     "before, %.2fs writing it)", path, blocked_s, waited_s, staged_s)
        else:
            log.info("checkpoint %s staged: training blocked %.2fs (%.2fs waiting for the write before, %.2fs "
                     "copying to host memory); writing in the background", path, blocked_s, waited_s, staged_s)
    return path


def reserve_staging(d: Dist, par: Parallel, optimizer, max_host_bytes: int | None = None) -> None:
    """Rank 0 on CUDA, outside FSDP: pin the host buffers of the coming saves on a thread, so
    that no save blocks for it, where they fit (`host_memory.decide`). Called before the first
    step, whose compilation (seconds of CPU work) the pinning overlaps; AdamW's state, not made
    before the first step, is reserved by the shapes it will have (`_adamw_state_to_come`)."""
    global _writer
    if d.rank != 0 or d.device.type != "cuda" or par.kind == "fsdp":
        return
    if _writer is None:
        _writer = CheckpointWriter()
    weights, optimizer_state = _state_to_stage(par, optimizer)
    if not optimizer.state:
        optimizer_state = _adamw_state_to_come(optimizer)
    tree = {"weights": weights, "optimizer": optimizer_state}
    if host_memory.decide(_writer, max_host_bytes, tree, None, None, None) == "pinned":
        _writer.reserve_in_background(tree)


def _adamw_state_to_come(optimizer) -> dict:
    """Tensors shaped as ``optimizer.state_dict()``'s state will be after its first step
    (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter, numbered in param-group order; the
    fused and capturable kernels keep ``step`` on the parameter's device). Shapes only."""
    state, index = {}, 0
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state[index] = {"step": step, "exp_avg": p.detach(), "exp_avg_sq": p.detach()}
            index += 1
    return {"state": state}


def _state_to_stage(par: Parallel, optimizer) -> tuple[dict | None, dict | None]:
    """Rank 0's weights and AdamW state as the checkpoint stores them, where they live.

    Under FSDP: `Parallel.full_state`, gathered to the CPU (a collective). Otherwise the live
    tensors themselves, tied aliases left out (as `Parallel.full_state` leaves them out), on
    their device: the stager's copy into its pinned buffers is then the only copy made.
    """
    if par.kind == "fsdp":
        return par.full_state(optimizer)
    if par.rank != 0:
        return None, None
    if par.adapters_only:  # LoRA: the trainable adapters alone (the base is the pretrained folder's)
        weights = {name: p.detach() for name, p in par.model.named_parameters() if p.requires_grad}
    else:
        weights = {name: t.detach() for name, t in par.model.state_dict().items() if name not in par.aliases}
    return weights, optimizer.state_dict()


def _live_storages(par: Parallel, optimizer) -> set[int]:
    """Storages training changes in place: parameters, buffers, AdamW state (local shards)."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return storage_addresses(itertools.chain(par.model.parameters(), par.model.buffers(), state))


def _on_written(outcome: Any) -> Callable[[Location], None] | None:
    if outcome is None:
        return None

    def written(path: Location) -> None:  # on the writer thread: one attribute set
        outcome.last_checkpoint = str(path)
    return written


def _on_ended(clock: AttemptClock | None) -> Callable[[WriteResult], None] | None:
    return None if clock is None else (lambda result: clock.saved_in_background(result.seconds))


def _await_final(d: Dist) -> None:
    """Wait for the final write (rank 0) and tell every rank how it went.

    Raises:
        CheckpointError: the final write failed (on every rank).
    """
    global _writer
    done = _writer.wait() if d.rank == 0 else None
    failed = done.step if done is not None and done.error is not None else 0
    if d.enabled:
        flag = torch.tensor([failed], device=d.device)
        dist.all_reduce(flag)  # the peers wait here for rank 0's write, as they waited at its barrier before
        failed = int(flag.item())
    if d.rank == 0:
        _writer.stager.clear()
        _writer = None
    if failed:
        _raise_failed(d, failed, done)


def _raise_failed(d: Dist, step: int, result: WriteResult | None) -> None:
    if d.rank == 0 and result is not None:
        raise ckpt.CheckpointError(f"writing checkpoint step {step} in the background failed: "
                                   f"{type(result.error).__name__}: {result.error}") from result.error
    raise ckpt.CheckpointError(f"rank 0's background write of checkpoint step {step} failed (rank 0 logs why)")


def finish_pending_write() -> None:
    """Rank 0, after a failure that ends training cleanly (divergence, a bad config): let the
    write in flight finish instead of abandoning it at exit. It holds a step before the failure
    (only finite weights are saved), the checkpoint to inspect or resume; ``last_checkpoint``
    names it once complete. A no-op without one (and on other ranks)."""
    global _writer
    if _writer is None:
        return
    result = _writer.wait()
    if result is not None and result.error is not None:
        log.warning("the background write of checkpoint step %d failed: %s", result.step, result.error)
    _writer.stager.clear()
    _writer = None


def close_pending_write() -> None:
    """Rank 0, on a failure that ends the process at once (SIGTERM, a lost peer): from now on no
    manifest is published, and one being published finishes first and is in
    ``last_checkpoint``. The result then names every checkpoint the process completed. A no-op
    without a write (and on other ranks)."""
    if _writer is not None:
        _writer.abandon()


def abandon_pending_write() -> None:
    """Abandon a write left in flight by an earlier training in this process and wait for its
    thread: it must not publish into (or race with) the run resumed now. For in-process callers
    after a failure; a new trainer process has none."""
    global _writer
    if _writer is not None:
        _writer.abandon()
        result = _writer.wait()
        if result is not None:
            log.warning("abandoned the background write of checkpoint step %d left by an earlier training in "
                        "this process (%s)", result.step, "complete" if result.error is None else result.error)
        _writer = None


def _versions() -> dict[str, str]:
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "numpy": np.__version__}
