"""The model a training attempt starts from: built or loaded, its initial weights, parallelised.

`start_model` is the trainer's one path from the job config to the wrapped model the steps train:
the job's model (`trainforge.trainer.model.job_model`), its initial weights (an ``init`` section,
or a pretrained folder's) unless the run already has a checkpoint of its own (a retry resumes
that instead), float8 linears under ``precision: fp8`` (trainer/float8.py), and DDP or FSDP2
(`trainforge.trainer.parallel.parallelize`). Open weights under FSDP2 are loaded after sharding,
each rank reading its own rows (docs/model.md, "Open weights").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from trainforge.trainer import float8, pretrained
from trainforge.trainer.adapters import apply_lora
from trainforge.trainer.config import JobConfig
from trainforge.trainer.dataset import Dataset
from trainforge.trainer.distributed import Dist
from trainforge.trainer.evaluate import loss_at_start
from trainforge.trainer.model import job_model, load_initial_weights
from trainforge.trainer.parallel import Parallel, parallelize
from trainforge.trainer.state import has_own_checkpoint

log = logging.getLogger(__name__)


@dataclass
class Started:
    model: torch.nn.Module  # the causal LM holding the parameters (sharded under FSDP2)
    par: Parallel
    n_params: int  # before sharding; tied weights counted once; LoRA adapters not counted
    at_start: dict[str, float]  # {"val/loss_at_start": ...} on rank 0 of a fresh pretrained start, else {}
    float8_report: str | None = None  # precision fp8: the conversion report (trainer/float8.py)


def start_model(cfg: JobConfig, d: Dist, dataset: Dataset) -> Started:
    """Build the job's model on ``d.device`` with its initial weights and wrap it (module doc)."""
    own = (cfg.init is not None or cfg.pretrained is not None) and has_own_checkpoint(cfg, d)
    fresh = cfg.pretrained is not None and not own  # the pretrained weights are the start
    # LoRA: the frozen base always comes from the folder (checkpoints hold the adapters alone),
    # whole on each rank before FSDP2 shards it (the adapters are made on real tensors).
    base = fresh or cfg.peft is not None
    shards = fresh and d.enabled and cfg.framework.parallelism == "fsdp" and cfg.peft is None
    at_start: dict[str, float] = {}
    with job_model(cfg, dataset, d.device, weights="shards" if shards else base) as model:
        if fresh and not shards and d.rank == 0:  # rank 0 alone, before any wrapper's collectives
            at_start = {"val/loss_at_start": loss_at_start(model, dataset, cfg.data.sequence_length, d.device)}
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.peft is not None:
        apply_lora(model, cfg.peft)
    if cfg.init is not None and not own:
        load_initial_weights(model, cfg.init.checkpoint, dataset.tokenizer_path, dataset.tokenizer_sha256)
    report = None
    if cfg.precision == "fp8":  # before compile and the wrappers; the state-dict names stay those of nn.Linear
        float8.check_device(d.device)
        report = float8.report(float8.convert(model, d.device))
        if d.rank == 0:
            log.info("%s", report)
    par = parallelize(model, cfg, d)
    if shards:
        with pretrained.open_folder(cfg.pretrained.folder) as folder:
            pretrained.fill_shards(par.model, folder, d.device)
        pretrained.check_materialised(par.model, par.model.config)
        log.info("FSDP2: each rank read only its rows of %s's shards", cfg.pretrained.source)
        loss = loss_at_start(par.model, dataset, cfg.data.sequence_length, d.device)  # every rank: FSDP2's forward
        par.model.reshard()  # a forward without backward leaves the root unsharded: the optimizer takes the shards
        at_start = {"val/loss_at_start": loss} if d.rank == 0 else {}
    return Started(model, par, n_params, at_start, report)
