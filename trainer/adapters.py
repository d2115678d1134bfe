"""LoRA adapters on a pretrained model, through ``peft`` (``training.peft``; docs/finetuning.md).

`apply_lora` freezes the model and adds the adapters (``peft.inject_adapter_in_model``: the
model keeps its class and its parameter names, so FSDP2, activation checkpointing, per-layer
compile and the loss see the same modules as without LoRA; the adapters' names gain only
``.lora_A.default`` / ``.lora_B.default``). Only the adapters train: the optimizer and every
checkpoint hold them alone, with the digest of the base weights they belong to
(`base_digest`), and a checkpoint is refused on another base. `merged_weights` folds them into
the base for a registration of full weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainforge.trainer.config import JobConfig, LoraSettings
from trainforge.trainer.errors import ConfigError

log = logging.getLogger(__name__)

#: ``target_modules: auto`` per ``config.model_type``: the attention and MLP projections.
AUTO_TARGETS: dict[str, tuple[str, ...]] = {
    **{family: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
       for family in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2",
                      "smollm3", "granite")},
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}
#: The adapter's name inside peft's modules (one adapter per model).
ADAPTER = "default"


def targets_for(model: torch.nn.Module, settings: LoraSettings) -> tuple[str, ...]:
    """The module names LoRA wraps: the spec's, each checked to match a linear layer, or the
    family's `AUTO_TARGETS`.

    Raises:
        ConfigError: ``auto`` on a family it knows no targets for, or a name that matches no
            ``torch.nn.Linear`` of the model (naming the names it has).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    if settings.target_modules is None:
        if model_type not in AUTO_TARGETS:
            raise ConfigError(f"training.peft.target_modules=auto knows no targets for model_type {model_type!r} "
                              f"(known: {', '.join(sorted(AUTO_TARGETS))}); expected a list of the model's linear "
                              f"layer names, e.g. from {sorted(linear - {'lm_head'})[:8]}")
        targets = tuple(t for t in AUTO_TARGETS[model_type] if t in linear)
        if not targets:
            raise ConfigError(f"training.peft.target_modules=auto: none of {AUTO_TARGETS[model_type]} is a linear "
                              f"layer of this {model_type} model (its linear layers: {sorted(linear)[:12]})")
        return targets
    unknown = [t for t in settings.target_modules if t not in linear]
    if unknown:
        raise ConfigError(f"training.peft.target_modules={list(settings.target_modules)}: {unknown} match no linear "
                          f"layer of this {model_type} model; expected names among {sorted(linear)}")
    return settings.target_modules


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Freeze ``model`` and add LoRA adapters to its target layers, in place; returns it.

    The adapters are initialised by peft's default (A Kaiming-uniform, B zero: the model's
    output is unchanged until the first step) and are fp32 like the model.
    """
    import peft

    targets = targets_for(model, settings)
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=list(targets), bias="none")
    model.requires_grad_(False)
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA r=%d alpha=%g on %s: %d trainable parameters of %d (%.2f%%)", settings.r, settings.alpha,
             ",".join(targets), trainable, total, 100.0 * trainable / max(total, 1))
    model._trainforge_lora = (settings, targets)  # noqa: SLF001 - read by is_lora / merged_weights
    return model


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "_trainforge_lora")


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as a checkpoint stores them: name -> contiguous fp32 CPU copy."""
    return {name: p.detach().to("cpu", torch.float32).contiguous().clone()
            for name, p in model.named_parameters() if p.requires_grad}


def load_adapter_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a LoRA checkpoint's adapters into ``model`` (adapters applied) in place.

    Raises:
        ValueError: the names are not exactly the model's adapters, or a shape differs (a
            checkpoint of another rank, targets or model).
    """
    expected = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(tensors) & set(expected) if tensors[n].shape != expected[n])
    if missing or unknown or wrong:
        raise ValueError(f"adapter weights do not match the model's adapters (training.peft): missing {missing[:3]}, "
                         f"unknown {unknown[:3]}, shape mismatch {wrong[:3]}")
    model.load_state_dict(tensors, strict=False)


@contextlib.contextmanager
def checkpoint_model(cfg: JobConfig, dataset: Any, weights: dict[str, torch.Tensor],
                     folder: Path | None = None) -> Iterator[torch.nn.Module]:
    """The job's model holding a checkpoint's ``weights`` (CPU, fp32), for validation and export:
    fresh weights filled with them, or with ``training.peft`` the pretrained base with the
    adapters applied and filled (``folder``: the base, already opened).

    Raises:
        ValueError: the weights do not match the model (names or shapes).
        ConfigError: the job's model cannot be built (its pretrained folder).
    """
    from trainforge.trainer.model import job_model, load_weights

    with job_model(cfg, dataset, weights=cfg.peft is not None, folder=folder) as model:
        if cfg.peft is None:
            load_weights(model, weights)
        else:
            apply_lora(model, cfg.peft)
            load_adapter_weights(model, weights)
        yield model


def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights with the adapters folded in (``W + B A * alpha / r``), under the base
    model's own names: what a registration of merged full weights stores. ``model`` is left
    as it was (the merge happens on copies)."""
    settings, targets = model._trainforge_lora  # noqa: SLF001
    scale = settings.alpha / settings.r
    state = {name: t for name, t in model.state_dict().items() if ".lora_" not in name}
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = name.replace(".base_layer.", ".")
        if name.endswith(".base_layer.weight"):
            prefix = name[: -len(".base_layer.weight")]
            a = model.get_parameter(f"{prefix}.lora_A.{ADAPTER}.weight").detach()
            b = model.get_parameter(f"{prefix}.lora_B.{ADAPTER}.weight").detach()
            tensor = tensor.detach() + (b.float() @ a.float()).to(tensor.dtype) * scale
        merged[key] = tensor.detach().clone()
    return merged


def base_digest(folder: Path | str) -> str:
    """SHA-256 of the base model's weight index (``model.safetensors.index.json``, else the
    single ``model.safetensors``'s header): what identifies the weights an adapter belongs to,
    without hashing gigabytes."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return hashlib.sha256(index.read_bytes()).hexdigest()
    single = folder / "model.safetensors"
    with open(single, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return hashlib.sha256(f.read(size)).hexdigest()


def adapter_base_sha256(cfg: JobConfig) -> str:
    """The digest of the pretrained weights a LoRA job's adapters are trained on (cached per
    process: the folder does not change while it runs)."""
    if cfg.pretrained.folder not in _BASE_SHA256:
        from trainforge.trainer.pretrained import open_folder

        with open_folder(cfg.pretrained.folder) as folder:
            _BASE_SHA256[cfg.pretrained.folder] = base_digest(folder)
    return _BASE_SHA256[cfg.pretrained.folder]


_BASE_SHA256: dict[str, str] = {}


def check_adapter_base(path: Any, meta: dict, cfg: JobConfig) -> None:
    """Refuse a LoRA checkpoint whose adapters were trained on other base weights.

    Raises:
        ConfigError: naming both digests (the base changed under the same spec: a new revision).
    """
    saved = (meta.get("adapter") or {}).get("base_sha256")
    here = adapter_base_sha256(cfg)
    if saved != here:
        raise ConfigError(f"checkpoint {path} holds LoRA adapters of base weights {saved}, but "
                          f"{cfg.pretrained.source} ({cfg.pretrained.folder}) now has {here}: adapters load only "
                          f"on the base they were trained on; pin model.pretrained's revision, or use a new "
                          f"checkpoint.dir")
