"""The pipeline spec: the typed model of one ``dags/pipelines/<name>.yaml`` file.

This module is the single source of truth for every field, its type, unit and default.
Nothing else parses pipeline YAML or re-declares a default: the DAG builder, the job-config
renderer, the CLI and the JSON Schema all read these classes.

Units are in field names or descriptions: ``*_s`` seconds (written as durations, see
:mod:`operators.spec.durations`), batch sizes in sequences of ``data.sequence_length`` tokens.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from operators.spec.base import SpecModel
from operators.spec.data import DataSection
from operators.spec.durations import DurationS
from operators.spec.registry import RegistrySection, ValidationSection

_DAG_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
_PRESETS = ("@once", "@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly")


class PipelineSection(SpecModel):
    name: str = Field(description="Pipeline name; becomes the Airflow dag_id.")
    description: str = Field("", description="Shown as the DAG's documentation in the Airflow UI.")
    owner: str = Field("trainforge", description="Airflow task owner.")
    tags: list[str] = Field(default_factory=list, description="Airflow DAG tags.")
    schedule: str | None = Field(
        None,
        description="Cron expression (5 fields), an Airflow preset (@daily, @weekly, ...), or "
        "null for manual runs only.",
    )
    start_date: dt.date = Field(dt.date(2026, 1, 1), description="First logical date (UTC).")
    catchup: bool = Field(False, description="Create runs for past intervals since start_date.")
    max_active_runs: int = Field(1, ge=1, le=64, description="Concurrent DAG runs.")
    retries: int = Field(0, ge=0, le=20, description="Default task retries.")
    retry_delay: DurationS = Field("5m", description="Default delay between task retries.")
    mlflow_experiment: str | None = Field(
        None, description="MLflow experiment for this pipeline's runs; defaults to the name."
    )

    @field_validator("name")
    @classmethod
    def _name_is_dag_id(cls, value: str) -> str:
        if not _DAG_ID.match(value):
            raise ValueError(
                f"not a valid dag_id (got {value!r}; expected letters, digits, '_', '.', '-')"
            )
        return value

    @field_validator("schedule")
    @classmethod
    def _schedule_known(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if value.startswith("@"):
            if value not in _PRESETS:
                raise ValueError(
                    f"unknown schedule preset (got {value!r}; expected one of "
                    f"{', '.join(_PRESETS)}, a cron expression or null)"
                )
            return value
        from croniter import croniter

        if len(value.split()) != 5 or not croniter.is_valid(value):
            raise ValueError(
                f"not a valid cron expression (got {value!r}; expected 5 fields like "
                f"'0 3 * * 1', a preset such as '@weekly', or null)"
            )
        return value


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


class LocalEngine(SpecModel):
    processes_per_node: int = Field(2, ge=1, le=64, description="torchrun --nproc-per-node.")
    distributed_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend; auto = nccl with GPUs, gloo on CPU."
    )
    threads_per_process: int = Field(1, ge=1, le=256, description="OMP_NUM_THREADS per rank.")


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
    run_timeout: DurationS = Field("6h", description="Longest a training launch may run.")
    collective_timeout: DurationS = Field(
        "2m", description="Collective timeout: how fast a dead rank is noticed."
    )
    poll_interval: DurationS = Field("5s", description="How often the trigger polls the job.")
    cancel_on_kill: bool = Field(True, description="Cancel the job when the task is killed.")


class TrainingSection(SpecModel):
    engine: Literal["local"] = Field("local", description="Where training runs.")
    local: LocalEngine = LocalEngine()
    optimization: OptimizationSection
    precision: Literal["fp32", "bf16"] = Field("fp32", description="Autocast precision.")
    checkpoint: CheckpointSection
    fault: FaultSection = FaultSection()
    log_every_steps: int = Field(10, ge=1, description="Metric and log-line interval in steps.")

    @property
    def world_size(self) -> int:
        return self.local.processes_per_node

    @model_validator(mode="after")
    def _batch_and_interval(self) -> TrainingSection:
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


class PipelineSpec(SpecModel):
    """One pipeline: data prep → training → checkpoint validation → model registration."""

    pipeline: PipelineSection
    data: DataSection
    model: ModelSection = ModelSection()
    training: TrainingSection
    validation: ValidationSection = ValidationSection()
    registry: RegistrySection

    @property
    def dag_id(self) -> str:
        return self.pipeline.name

    @property
    def experiment_name(self) -> str:
        return self.pipeline.mlflow_experiment or self.pipeline.name
