"""Data parallelism of the trainer (job config ``framework``): DDP or FSDP2, and what depends on it.

`parallelize` wraps the freshly built model once; the returned `Parallel` is everything the
training loop and the checkpoint code need to know about the wrapping: ``ddp`` replicates the
parameters and all-reduces the gradients (optionally through a compression hook: ``fp16``,
``bf16`` or ``powersgd``, trainer/powersgd.py); ``fsdp`` shards them with FSDP2 ``fully_shard``
on every decoder layer, then on the root, and reduce-scatters the gradients. Without torchrun
(one process, no process group) the model is used as it is and neither applies. Both run on CPU
(gloo) and on CUDA.

Checkpoints have one layout whatever the parallelism (full, unsharded weights and the AdamW
state, gathered to rank 0 under FSDP), so a checkpoint resumes under either parallelism and any
world size. The table, what was checked on CPU, the PowerSGD settings and its state: see
docs/trainer.md, "Parallelism and gradient compression".
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from trainforge.trainer.adapters import adapter_weights, is_lora, load_adapter_weights
from trainforge.trainer.compile import compile_layers, missing_compiler
from trainforge.trainer.config import ConfigError, JobConfig
from trainforge.trainer.distributed import Dist
from trainforge.trainer.model import (check_weights, decoder_layers, enable_activation_checkpointing, load_weights,
                                      tied_aliases, weights_state_dict)
from trainforge.trainer.powersgd import PowerSGDHook, powersgd_hook

log = logging.getLogger(__name__)
# What only FSDP2 uses (torch.distributed.fsdp, .tensor, .checkpoint.state_dict) is imported where
# it is used, so a DDP run's startup does not pay for it: docs/trainer.md, "Startup".


@dataclass
class Parallel:
    """The model as the training loop sees it after `parallelize`."""

    kind: str  # "single" (no process group) | "ddp" | "fsdp"
    model: torch.nn.Module  # the causal LM holding the parameters (DTensor shards under fsdp)
    module: torch.nn.Module  # what the forward pass calls: the DDP wrapper, else ``model``
    shapes: dict[str, torch.Size]  # full (unsharded) state-dict shapes
    aliases: dict[str, str]  # tied state-dict names -> the name stored in checkpoints
    rank: int
    powersgd: PowerSGDHook | None = None  # the DDP hook's state under gradient_compression "powersgd"
    compiled: bool = False  # the decoder layers are torch.compile'd (framework.compile, a compiler found)
    adapters_only: bool = False  # LoRA (training.peft): checkpoints hold the trainable adapters alone

    @contextmanager
    def grad_sync(self, sync: bool) -> Iterator[None]:
        """Context of one micro-batch's forward and backward: gradients are reduced across
        ranks only when ``sync`` (the last micro-batch of a step), else they accumulate locally
        (DDP ``no_sync``; FSDP2 ``set_requires_gradient_sync``, unsharded gradients kept)."""
        if self.kind == "ddp" and not sync:
            with self.module.no_sync():
                yield
            return
        if self.kind == "fsdp":
            self.model.set_requires_gradient_sync(sync)
        yield

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global L2 norm of all gradients to ``max_norm``; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if self.kind == "fsdp":
            from torch.distributed.tensor import DTensor

            if isinstance(norm, DTensor):  # a replicated DTensor, the same on every rank
                norm = norm.full_tensor()
        return norm.item()

    def nonfinite_parameters(self) -> int:
        """How many of this rank's parameter tensors (local shards under FSDP) hold NaN or inf."""
        return sum(int(not torch.isfinite(_local(p)).all()) for p in self.model.parameters())

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict | None]:
        """``(weights, optimizer_state)`` as a checkpoint stores them, on rank 0; ``(None, None)`` elsewhere.

        weights: name -> contiguous fp32 CPU tensor, tied aliases left out. Under FSDP this is a
        collective (every rank must call it); otherwise only rank 0 does any work.
        """
        if self.kind == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)

            full_to_cpu = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                           ignore_frozen_params=self.adapters_only)
            weights = get_model_state_dict(self.model, options=full_to_cpu)  # {} on ranks > 0
            by_name = get_optimizer_state_dict(self.model, optimizer, options=full_to_cpu)
            if self.rank != 0:
                return None, None
            weights = {n: t.contiguous() for n, t in weights.items() if n not in self.aliases}
            return weights, optimizer_state_by_index(by_name, self.param_names(optimizer))
        if self.rank != 0:
            return None, None
        if self.adapters_only:
            return adapter_weights(self.model), optimizer.state_dict()
        return weights_state_dict(self.model), optimizer.state_dict()

    def load_full_state(self, weights: dict[str, torch.Tensor], optimizer_state: dict,
                        optimizer: torch.optim.Optimizer) -> None:
        """Load a checkpoint's weights and optimizer state (as `full_state` returns them) on every rank.

        Raises:
            ValueError: the weights do not match the model (names or shapes).
        """
        if self.kind != "fsdp":
            (load_adapter_weights if self.adapters_only else load_weights)(self.model, weights)
            optimizer.load_state_dict(optimizer_state)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        full = dict(weights)  # set_model_state_dict replaces the values in place
        if self.adapters_only:  # the adapters alone; the frozen base came from the pretrained folder
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            check_weights({n: self.shapes[n] for n in trainable}, set(), weights)
        else:
            check_weights(self.shapes, set(self.aliases), weights)
            for alias, name in self.aliases.items():
                full[alias] = full[name]
        set_model_state_dict(self.model, full, options=StateDictOptions(  # each rank keeps its shard
            full_state_dict=True, strict=not self.adapters_only))
        by_name = optimizer_state_by_name(optimizer_state, self.param_names(optimizer))
        set_optimizer_state_dict(self.model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))

    def param_names(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """Parameter names in the optimizer's numbering (param groups in order, then parameters)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _local(p: torch.Tensor) -> torch.Tensor:
    if "torch.distributed.tensor" not in sys.modules:  # then no tensor is a DTensor
        return p
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def optimizer_state_by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A name-keyed optimizer state dict (``get_optimizer_state_dict``) in `Optimizer.state_dict` form."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def optimizer_state_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Inverse of `optimizer_state_by_index`."""
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def parallelize(model: torch.nn.Module, cfg: JobConfig, d: Dist) -> Parallel:
    """Apply ``cfg.framework`` to ``model`` (on ``d.device``, not yet wrapped); build the optimizer after this.

    Order: activation checkpointing, compiling each decoder layer (``framework.compile``:
    trainer/compile.py), then FSDP2 sharding (each compiled layer first, then the root) or the DDP
    wrapper and its communication hook.
    """
    fw = cfg.framework
    lora = is_lora(model)
    aliases = tied_aliases(model)
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    if fw.activation_checkpointing:
        enable_activation_checkpointing(model)
    compiled = fw.compile_on(d.device.type)
    missing = missing_compiler(d.device.type) if compiled else None
    if missing and fw.compile is True:
        raise ConfigError(f"framework.compile=true needs {missing}; install one where the trainer runs (the "
                          f"image), or set training.framework.compile to false or auto")
    if missing:
        compiled = False
        log.warning("framework.compile=auto: training eager, torch.compile needs %s", missing)
    if compiled:
        log.info("torch.compile: %d decoder layers compiled in place (framework.compile=%r on %s)",
                 compile_layers(model), fw.compile, d.device.type)
    if not d.enabled:
        if fw.parallelism != "ddp" or fw.gradient_compression != "none":
            log.info("one process without torchrun: framework.parallelism=%r and gradient_compression=%r "
                     "have nothing to shard or compress", fw.parallelism, fw.gradient_compression)
        return Parallel("single", model, model, shapes, aliases, d.rank, compiled=compiled, adapters_only=lora)
    if fw.parallelism == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(d.device.type, (d.world_size,))
        layers = decoder_layers(model)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        log.info("FSDP2: %d decoder layers and the root sharded over %d ranks", len(layers), d.world_size)
        return Parallel("fsdp", model, model, shapes, aliases, d.rank, compiled=compiled, adapters_only=lora)
    ddp = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    powersgd = register_compression(ddp, cfg)
    return Parallel("ddp", model, ddp, shapes, aliases, d.rank, powersgd, compiled=compiled, adapters_only=lora)


def register_compression(ddp: DDP, cfg: JobConfig) -> PowerSGDHook | None:
    """Register the DDP communication hook for ``framework.gradient_compression`` (none: DDP's own).

    Returns the hook's state under ``powersgd`` (checkpointed: trainer/powersgd.py), else None.
    """
    fw = cfg.framework
    hook = None
    if fw.gradient_compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif fw.gradient_compression == "bf16":
        nccl = dist.get_backend() == "nccl"
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if nccl else bf16_compress_any_backend_hook)
    elif fw.gradient_compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=fw.powersgd_rank,
            start_powerSGD_iter=max(2, cfg.optim.warmup_steps),
            random_seed=cfg.optim.seed % 2**32,  # numpy RandomState seed for the low-rank factors
        )
        hook = PowerSGDHook(state, wait_each_bucket=dist.get_backend() != "nccl")  # why: trainer/powersgd.py
        ddp.register_comm_hook(hook, powersgd_hook)
    if fw.gradient_compression != "none":
        log.info("DDP gradient compression: %s%s", fw.gradient_compression,
                 f" (rank {fw.powersgd_rank}, start_powerSGD_iter {max(2, cfg.optim.warmup_steps)})"
                 if fw.gradient_compression == "powersgd" else "")
    return hook


# No annotations on purpose: DDP checks a hook's annotations by identity, and this module's
# `from __future__ import annotations` would turn them into strings it rejects.
def bf16_compress_any_backend_hook(process_group, bucket):
    """`default_hooks.bf16_compress_hook` for backends other than NCCL (gloo on CPU).

    The same algorithm (cast the bucket to bfloat16, divide by the world size, all-reduce, copy
    back into the fp32 bucket). DDP refuses torch's hook by its name unless CUDA with NCCL >=
    2.10 (or XPU) is present, but gloo all-reduces bfloat16 too (checked on torch 2.13).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()  # (n,) fp32: this bucket's gradients, flattened
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)
