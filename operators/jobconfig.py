"""Render the trainer's job config (docs/contracts.md "Job config") from a pipeline spec.

Pure: the same spec, dataset and identity always give the same JSON, which is what
``trainforge render`` prints and what the ``train`` task writes to ``job.json``.
"""

from __future__ import annotations

from typing import Any

from trainforge.contract import JOB_FORMAT, RETRY_SECTION
from trainforge.engines.base import JobIdentity, TrainingJob
from trainforge.pipeline.spec import PipelineSpec


def init_block(checkpoint: str, source: str) -> dict[str, str]:
    """The job config's ``init`` section: start from these weights (fresh optimizer).

    Args:
        checkpoint: a folder or ``s3://`` prefix holding either a trainer checkpoint
            (``step-XXXXXXXX/`` with its manifest) or a Hugging Face model folder
            (``config.json`` + ``model.safetensors``, what registration uploads).
        source: where it came from, for logs and checkpoint metadata: ``models:/<name>/<version>``
            (a registered model) or ``stage:<name>`` (another stage of the pipeline).
    """
    return {"checkpoint": checkpoint, "source": source}


def render_job_config(
    spec: PipelineSpec, dataset_dir: str, checkpoint_dir: str, identity: JobIdentity,
    init: dict[str, str] | None = None, pretrained: dict[str, str | None] | None = None,
    retry: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The JSON job config the trainer reads. Batch sizes count sequences.

    ``init`` (see :func:`init_block`) starts training from existing weights when the run has no
    checkpoint of its own; ``model.config_overrides`` appears only when the spec sets some,
    ``distributed.world_size_change`` only when it is not the default ``continue``,
    ``framework.compile_fallback`` only when not ``error`` and ``data.packing`` only when true,
    so configs of specs without them are unchanged. ``retry``: how this try runs unlike the spec
    (``{"micro_batch_size": m}`` after an out of memory: trainforge.oom_retry), when given.
    ``pretrained``: the resolved ``model.pretrained`` (trainforge.model_source,
    ``ResolvedModel.job_section()``), required when the spec sets it; the model section is then
    the reduced one of the contract.

    Raises:
        ValueError: the spec sets ``model.pretrained`` and ``pretrained`` is None, or the reverse.
    """
    config = _render(spec, dataset_dir, checkpoint_dir, identity)
    if (spec.model.pretrained is None) != (pretrained is None):
        raise ValueError(f"model.pretrained is {spec.model.pretrained!r} but the resolved "
                         f"pretrained section is {pretrained!r}: resolve the spec's source with "
                         f"trainforge.model_source.resolve_pretrained and pass its job_section()")
    if spec.training.peft is not None:
        config["peft"] = spec.training.peft.model_dump(mode="json")
    if pretrained is not None:
        config["model"] = pretrained_model_section(spec)
        config["pretrained"] = {"folder": pretrained["folder"], "source": pretrained["source"],
                                "revision": pretrained.get("revision")}
    if spec.model.config_overrides:
        config["model"]["config_overrides"] = dict(sorted(spec.model.config_overrides.items()))
    if spec.data.packing:  # like world_size_change: configs of specs without it are unchanged
        config["data"]["packing"] = True
    if spec.training.fault.world_size_change != "continue":
        # Like config_overrides: configs of specs that keep the default are unchanged.
        config["distributed"]["world_size_change"] = spec.training.fault.world_size_change
    if spec.training.framework.compile_fallback != "error":  # the same: the default is the trainer's
        config["framework"]["compile_fallback"] = spec.training.framework.compile_fallback
    if init is not None:
        config["init"] = init_block(init["checkpoint"], init["source"])
    if retry is not None:
        config[RETRY_SECTION] = dict(retry)
    return config


def pretrained_model_section(spec: PipelineSpec) -> dict[str, Any]:
    """The job config's ``model`` section with ``model.pretrained``: the architecture is the
    folder's config.json; ``dropout`` (its attention_dropout) only when the spec sets it."""
    model = spec.model
    return {"family": "pretrained",
            "dropout": model.dropout if "dropout" in model.model_fields_set else None}


def _render(
    spec: PipelineSpec, dataset_dir: str, checkpoint_dir: str, identity: JobIdentity
) -> dict[str, Any]:
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
            "compile": spec.training.framework.compile,  # "auto", true or false
        },
        "checkpoint": {
            "dir": checkpoint_dir,
            "interval_steps": spec.training.checkpoint.interval_steps,
            "keep_last": spec.training.checkpoint.keep_last,
            **({"max_host_bytes": spec.training.checkpoint.max_host_bytes}
               if spec.training.checkpoint.max_host_bytes is not None else {}),
        },
        "logging": {"log_every_steps": spec.training.log_every_steps},
        "distributed": {
            # An engine whose block names a collective backend uses it; the others choose like
            # 'auto': nccl with GPUs, gloo without.
            "backend": getattr(spec.training.engine_block, "distributed_backend", "auto"),
            "collective_timeout_s": spec.training.fault.collective_timeout,
        },
    }


def build_training_job(
    spec: PipelineSpec,
    dataset_dir: str,
    checkpoint_dir: str,
    identity: JobIdentity,
    env: dict[str, str],
    init: dict[str, str] | None = None,
    secret_env: dict[str, str] | None = None,
    secret_env_source: str = "",
    pretrained: dict[str, str | None] | None = None,
    retry: dict[str, int] | None = None,
) -> TrainingJob:
    """The engine-neutral job for the spec's training section (``init``, ``pretrained``,
    ``retry``: see :func:`render_job_config`).

    The spec's S3 endpoint (``storage.endpoint_url`` or ``data.s3_endpoint_url``) reaches every
    rank as ``AWS_ENDPOINT_URL_S3`` (``env`` may override it). ``secret_env`` (S3 keys of the
    Airflow connection ``storage.aws_conn_id``, from ``secret_env_source``) is never part of
    a rendered request: see ``TrainingJob.secret_env``.
    """
    resources = spec.training.resources
    endpoint = spec.s3_endpoint_url
    env = {**({"AWS_ENDPOINT_URL_S3": endpoint} if endpoint else {}), **env}
    return TrainingJob(
        identity=identity,
        config=render_job_config(spec, dataset_dir, checkpoint_dir, identity, init=init,
                                 pretrained=pretrained, retry=retry),
        nodes=resources.max_nodes,
        min_nodes=resources.min_nodes if resources.elastic else None,
        processes_per_node=resources.processes_per_node,
        env=dict(env),
        max_restarts=spec.training.fault.max_restarts,
        threads_per_process=resources.cpus_per_process,
        gpus_per_node=resources.gpus_per_node,
        memory_gib=resources.memory_gib,
        image=resources.image,
        engine_options=spec.training.engine_block.model_dump(mode="json"),
        max_runtime_s=float(spec.training.fault.run_timeout),
        startup_timeout_s=float(spec.training.fault.startup_timeout),
        secret_env=dict(secret_env or {}),
        secret_env_source=secret_env_source,
    )
