"""The pipeline spec: the typed model of one ``dags/pipelines/<name>.yaml`` file.

This module is the single source of truth for every field, its type, unit and default.
Nothing else parses pipeline YAML or re-declares a default: the DAG builder, the job-config
renderer, the CLI and the JSON Schema all read these classes.

Units are in field names or descriptions: ``*_s`` seconds (written as durations, see
:mod:`operators.spec.durations`), batch sizes in sequences of ``data.sequence_length`` tokens.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from operators.spec.base import SpecModel
from operators.spec.data import DataSection
from operators.spec.durations import DurationS
from operators.spec.engines import KubernetesEngine, LocalEngine, RayEngine
from operators.spec.pipeline import PipelineSection
from operators.spec.registry import RegistrySection, ValidationSection



class ModelSection(SpecModel):
    family: Literal["llama"] = Field("llama", description="Architecture family (transformers).")
    hidden_size: int = Field(256, ge=8, le=65_536, description="Model width d_model.")
    num_layers: int = Field(4, ge=1, le=512, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, le=1024, description="Attention heads.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (grouped-query attention); default num_heads."
    )
    intermediate_size: int | None = Field(
        None, ge=8, description="MLP width; default 8/3 x hidden_size rounded up to 64 (Llama)."
    )
    rope_theta: float = Field(10_000.0, gt=0, description="RoPE base.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Attention dropout probability.")
    tie_word_embeddings: bool = Field(True, description="Share input and output embeddings.")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size must be divisible by num_heads (got {self.hidden_size} and "
                f"{self.num_heads})"
            )
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(
                f"num_heads must be divisible by num_kv_heads (got {self.num_heads} and {kv})"
            )
        return self

    @property
    def resolved_intermediate_size(self) -> int:
        """MLP width; Llama's default is 8/3 x d_model rounded up to a multiple of 64."""
        if self.intermediate_size:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64


class ResourcesSection(SpecModel):
    nodes: int = Field(1, ge=1, le=4096, description="Machines in the training job.")
    processes_per_node: int = Field(
        2, ge=1, le=64, description="Ranks per machine (torchrun --nproc-per-node); one per GPU "
        "when gpus_per_node is set."
    )
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs requested per machine.")
    cpus_per_process: int = Field(
        1, ge=1, le=256, description="CPU cores per rank; also its OMP_NUM_THREADS."
    )
    memory_gib: float | None = Field(None, gt=0, description="Memory per machine, GiB.")
    image: str | None = Field(None, description="Container image of the trainer (cluster engines).")

    @model_validator(mode="after")
    def _gpus(self) -> ResourcesSection:
        if self.gpus_per_node and self.processes_per_node != self.gpus_per_node:
            raise ValueError(
                f"processes_per_node must equal gpus_per_node when GPUs are requested, one rank "
                f"per GPU (got {self.processes_per_node} and {self.gpus_per_node})"
            )
        return self


class FrameworkSection(SpecModel):
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast precision of forward and backward (fp16 uses loss scaling)."
    )
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp", description="Data parallelism: replicated (DDP) or sharded (FSDP) parameters."
    )
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="DDP communication hook compressing gradients before all-reduce."
    )
    powersgd_rank: int = Field(1, ge=1, le=64, description="Rank of PowerSGD's approximation.")
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save memory."
    )

    @model_validator(mode="after")
    def _combination(self) -> FrameworkSection:
        if self.parallelism == "fsdp" and self.gradient_compression != "none":
            raise ValueError(
                f"gradient_compression is a DDP communication hook and does not apply to FSDP "
                f"(got {self.gradient_compression!r} with parallelism 'fsdp'; expected 'none')"
            )
        return self


class OptimizationSection(SpecModel):
    max_steps: int = Field(ge=1, description="Optimizer steps to train.")
    global_batch_size: int = Field(
        ge=1, description="Sequences per optimizer step, over all ranks and micro-batches."
    )
    micro_batch_size: int = Field(ge=1, description="Sequences per rank per forward pass.")
    learning_rate: float = Field(gt=0, le=10, description="Peak learning rate (AdamW).")
    min_learning_rate: float | None = Field(
        None, ge=0, description="Floor of the cosine decay; default learning_rate / 10."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warm-up, from learning_rate to min_learning_rate."
    )
    weight_decay: float = Field(0.1, ge=0, le=1, description="AdamW weight decay.")
    beta1: float = Field(0.9, gt=0, lt=1)
    beta2: float = Field(0.95, gt=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables.")
    seed: int = Field(1234, ge=0, description="Seed of weights and data order.")

    @model_validator(mode="after")
    def _consistent(self) -> OptimizationSection:
        if self.micro_batch_size > self.global_batch_size:
            raise ValueError(
                f"micro_batch_size may not exceed global_batch_size (got "
                f"{self.micro_batch_size} > {self.global_batch_size})"
            )
        if self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"warmup_steps must be below max_steps (got {self.warmup_steps} >= "
                f"{self.max_steps})"
            )
        if self.min_learning_rate is not None and self.min_learning_rate > self.learning_rate:
            raise ValueError(
                f"min_learning_rate must not exceed learning_rate (got "
                f"{self.min_learning_rate} > {self.learning_rate})"
            )
        return self

    @property
    def resolved_min_learning_rate(self) -> float:
        if self.min_learning_rate is None:
            return self.learning_rate / 10
        return self.min_learning_rate


class CheckpointSection(SpecModel):
    interval_steps: int = Field(ge=1, description="Save a checkpoint every this many steps.")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept; the newest valid is never deleted.")
    uri: str = Field(
        "checkpoints",
        description="Root of checkpoint folders; a run writes under <uri>/<dag_id>/<run_id>/.",
    )


class FaultSection(SpecModel):
    max_restarts: int = Field(0, ge=0, le=100, description="torchrun elastic restarts per launch.")
    startup_timeout: DurationS = Field(
        "10m", description="Longest a job may wait to be admitted and start running."
    )
    run_timeout: DurationS = Field("6h", description="Longest a training launch may run.")
    collective_timeout: DurationS = Field(
        "2m", description="Collective timeout: how fast a dead rank is noticed."
    )
    poll_interval: DurationS = Field("5s", description="How often the trigger polls the job.")
    cancel_on_kill: bool = Field(True, description="Cancel the job when the task is killed.")


class TrainingSection(SpecModel):
    engine: Literal["local", "kubernetes", "ray"] = Field(
        "local", description="Where training runs: 'local' (torchrun on the Airflow worker's "
        "machine), 'kubernetes' (Kubeflow TrainJob or PyTorchJob) or 'ray' (Ray job API). The "
        "block of the same name configures it."
    )
    resources: ResourcesSection = ResourcesSection()
    local: LocalEngine = LocalEngine()
    kubernetes: KubernetesEngine | None = Field(
        None, description="Kubernetes engine settings (engine: kubernetes)."
    )
    ray: RayEngine | None = Field(None, description="Ray engine settings (engine: ray).")
    optimization: OptimizationSection
    framework: FrameworkSection = FrameworkSection()
    checkpoint: CheckpointSection
    fault: FaultSection = FaultSection()
    log_every_steps: int = Field(10, ge=1, description="Metric and log-line interval in steps.")

    @property
    def engine_block(self) -> SpecModel:
        """The settings block of the chosen engine (defaults when the block is omitted)."""
        if self.engine == "kubernetes":
            return self.kubernetes or KubernetesEngine()
        if self.engine == "ray":
            return self.ray or RayEngine()
        return self.local

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.processes_per_node

    @model_validator(mode="after")
    def _batch_and_interval(self) -> TrainingSection:
        for block in ("local", "kubernetes", "ray"):
            given = getattr(self, block)
            # a dumped-and-reloaded spec carries `kubernetes: null` and the default local block
            if block != self.engine and given is not None and given != type(given)():
                raise ValueError(
                    f"the {block!r} block configures engine {block!r}, but engine is "
                    f"{self.engine!r} (remove the block, or set engine: {block})"
                )
        if self.engine in ("local", "ray") and self.resources.nodes != 1:
            raise ValueError(
                f"the {self.engine} engine runs one torchrun group on one machine (got "
                f"resources.nodes {self.resources.nodes}; expected 1; use the kubernetes engine "
                f"for several nodes)"
            )
        if self.engine == "kubernetes" and not self.resources.image:
            raise ValueError(
                "the kubernetes engine needs resources.image, the trainer's container image "
                "(got none; expected e.g. 'ghcr.io/acme/trainforge-trainer:0.1.0')"
            )
        opt = self.optimization
        per_step = opt.micro_batch_size * self.world_size
        if opt.global_batch_size % per_step:
            raise ValueError(
                f"optimization.global_batch_size must be divisible by micro_batch_size x world "
                f"size (got {opt.global_batch_size}; {opt.micro_batch_size} x {self.world_size} "
                f"= {per_step})"
            )
        if self.checkpoint.interval_steps > opt.max_steps:
            raise ValueError(
                f"checkpoint.interval_steps must fit in optimization.max_steps (got "
                f"{self.checkpoint.interval_steps} > {opt.max_steps})"
            )
        return self


class CostSection(SpecModel):
    """Prices and power used to account each training launch (logged to the MLflow run)."""

    gpu_hour_price: float = Field(0.0, ge=0, description="Price of one GPU-hour, in currency.")
    cpu_hour_price: float = Field(0.0, ge=0, description="Price of one CPU-core-hour.")
    currency: str = Field("USD", min_length=1, max_length=8, description="Currency of the prices.")
    gpu_power_watts: float = Field(
        700.0, ge=0, description="Average board power of one GPU while training, watts "
        "(default: the H100/H200 SXM TDP)."
    )
    cpu_core_power_watts: float = Field(
        10.0, ge=0, description="Average power of one busy CPU core, watts."
    )


class PipelineSpec(SpecModel):
    """One pipeline: data prep → training → checkpoint validation → model registration."""

    pipeline: PipelineSection
    data: DataSection
    model: ModelSection = ModelSection()
    training: TrainingSection
    validation: ValidationSection = ValidationSection()
    registry: RegistrySection
    cost: CostSection = CostSection()

    @model_validator(mode="after")
    def _cluster_storage(self) -> PipelineSpec:
        # Pods of a Kubernetes job do not share the Airflow worker's disk: the dataset and the
        # checkpoints must live where every node can reach them.
        if self.training.engine == "kubernetes":
            for field, value in (("data.output_uri", self.data.output_uri),
                                 ("training.checkpoint.uri", self.training.checkpoint.uri)):
                if not value.startswith("s3://"):
                    raise ValueError(
                        f"{field} must be an s3:// URI with the kubernetes engine, where every "
                        f"node can read it (got {value!r}; expected e.g. 's3://bucket/prefix')"
                    )
        return self

    @property
    def dag_id(self) -> str:
        return self.pipeline.name

    @property
    def experiment_name(self) -> str:
        return self.pipeline.mlflow_experiment or self.pipeline.name
