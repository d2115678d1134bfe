"""Render the trainer's job config (docs/contracts.md "Job config") from a pipeline spec.

Pure: the same spec, dataset and identity always give the same JSON, which is what
``trainforge render`` prints and what the ``train`` task writes to ``job.json``.
"""

from __future__ import annotations

from typing import Any

from operators.backends.base import JobIdentity, TrainingJob
from operators.spec.model import PipelineSpec

JOB_FORMAT = "trainforge.job/v1"


def render_job_config(
    spec: PipelineSpec, dataset_dir: str, checkpoint_dir: str, identity: JobIdentity
) -> dict[str, Any]:
    """The JSON job config the trainer reads. Batch sizes count sequences."""
    model = spec.model
    opt = spec.training.optimization
    return {
        "format": JOB_FORMAT,
        "identity": identity.to_dict(),
        "data": {"dataset_dir": dataset_dir, "sequence_length": spec.data.sequence_length},
        "model": {
            "family": model.family,
            "hidden_size": model.hidden_size,
            "num_layers": model.num_layers,
            "num_heads": model.num_heads,
            "num_kv_heads": model.num_kv_heads or model.num_heads,
            "intermediate_size": model.resolved_intermediate_size,
            "rope_theta": model.rope_theta,
            "dropout": model.dropout,
            "tie_word_embeddings": model.tie_word_embeddings,
        },
        "optim": {
            "max_steps": opt.max_steps,
            "global_batch_size": opt.global_batch_size,
            "micro_batch_size": opt.micro_batch_size,
            "learning_rate": opt.learning_rate,
            "min_learning_rate": opt.resolved_min_learning_rate,
            "warmup_steps": opt.warmup_steps,
            "weight_decay": opt.weight_decay,
            "beta1": opt.beta1,
            "beta2": opt.beta2,
            "grad_clip": opt.grad_clip,
            "seed": opt.seed,
            "lr_schedule": opt.lr_schedule,
        },
        "precision": spec.training.framework.precision,
        "framework": {
            "parallelism": spec.training.framework.parallelism,
            "gradient_compression": spec.training.framework.gradient_compression,
            "powersgd_rank": spec.training.framework.powersgd_rank,
            "activation_checkpointing": spec.training.framework.activation_checkpointing,
        },
        "checkpoint": {
            "dir": checkpoint_dir,
            "interval_steps": spec.training.checkpoint.interval_steps,
            "keep_last": spec.training.checkpoint.keep_last,
        },
        "logging": {"log_every_steps": spec.training.log_every_steps},
        "distributed": {
            # Cluster engines choose like 'auto': nccl with GPUs, gloo without.
            "backend": (spec.training.local.distributed_backend
                        if spec.training.engine == "local" else "auto"),
            "collective_timeout_s": spec.training.fault.collective_timeout,
        },
    }


def build_training_job(
    spec: PipelineSpec,
    dataset_dir: str,
    checkpoint_dir: str,
    identity: JobIdentity,
    env: dict[str, str],
) -> TrainingJob:
    """The engine-neutral job for the spec's training section."""
    resources = spec.training.resources
    return TrainingJob(
        identity=identity,
        config=render_job_config(spec, dataset_dir, checkpoint_dir, identity),
        nodes=resources.nodes,
        processes_per_node=resources.processes_per_node,
        env=dict(env),
        max_restarts=spec.training.fault.max_restarts,
        threads_per_process=resources.cpus_per_process,
        gpus_per_node=resources.gpus_per_node,
        memory_gib=resources.memory_gib,
        image=resources.image,
        engine_options=spec.training.engine_block.model_dump(mode="json"),
        max_runtime_s=float(spec.training.fault.run_timeout),
    )
