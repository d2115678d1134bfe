"""The pipeline spec, PipelineSpec: the typed model of one ``dags/pipelines/<name>.yaml`` file,
with its ``optimization``, ``checkpoint`` and ``training`` sections; each other section has its
own module (``pipeline.py`` the ``pipeline:`` section, ``architecture.py`` the ``model:``
section, ``framework.py`` ``training.framework``, ...). Nothing else parses pipeline YAML or re-declares a default: the DAG
builder, the job-config renderer, the CLI and the JSON Schema all read these classes.

Units are in field names or descriptions: ``*_s`` seconds (written as durations, see
:mod:`trainforge.pipeline.durations`), batch sizes in sequences of ``data.sequence_length`` tokens.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from trainforge.contract import S3_URI
from trainforge.pipeline.architecture import ModelSection, fine_tuning_errors, pretrained_errors
from trainforge.pipeline.peft import PeftSection
from trainforge.pipeline.data import _SCHEME, DataSection, StorageSection, same_endpoint
from trainforge.pipeline.engines import (
    block_fields,
    connection_secret_errors,
    engine_block,
    engine_field,
    misplaced_blocks,
    needs_s3,
    size_errors,
    storage_errors,
)
from trainforge.pipeline.cost import CostSection
from trainforge.pipeline.fault import FaultSection
from trainforge.pipeline.framework import FrameworkSection, fp8_device_errors, fp8_token_errors
from trainforge.pipeline.pipeline import PipelineSection
from trainforge.pipeline.registry import RegistrySection, ValidationSection
from trainforge.pipeline.resources import ResourcesSection, batch_errors, elastic_fault_errors
from trainforge.pipeline.stage_checks import check_stages, rewrap
from trainforge.pipeline.stages import stage_model
from trainforge.sections import SpecModel, field_errors


class OptimizationSection(SpecModel):
    max_steps: int = Field(ge=1, le=1_000_000_000, description="Optimizer steps to train.")
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
    seed: int = Field(1234, ge=0, le=2**63 - 1, description="Seed of weights and data order.")

    @model_validator(mode="after")
    def _consistent(self) -> OptimizationSection:
        errors = []
        if self.micro_batch_size > self.global_batch_size:
            errors.append((("micro_batch_size",), f"micro_batch_size may not exceed "
                           f"global_batch_size (got {self.micro_batch_size} > "
                           f"{self.global_batch_size})", self.micro_batch_size, ()))
        if self.warmup_steps >= self.max_steps:
            errors.append((("warmup_steps",), f"warmup_steps must be below max_steps (got "
                           f"{self.warmup_steps} >= {self.max_steps})", self.warmup_steps, ()))
        if self.min_learning_rate is not None and self.min_learning_rate > self.learning_rate:
            errors.append((("min_learning_rate",), f"min_learning_rate must not exceed "
                           f"learning_rate (got {self.min_learning_rate} > {self.learning_rate})",
                           self.min_learning_rate, ()))
        if errors:
            raise field_errors(OptimizationSection, *errors)
        return self

    @property
    def resolved_min_learning_rate(self) -> float:
        if self.min_learning_rate is None:
            return self.learning_rate / 10
        return self.min_learning_rate


class CheckpointSection(SpecModel):
    interval_steps: int = Field(ge=1, description="Save a checkpoint every this many steps.")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept; the newest valid is never deleted.")
    max_host_bytes: int | None = Field(
        None, ge=0, description="Host memory (bytes) rank 0 may use to stage a checkpoint for its "
        "background write; default: what the job's cgroup limit, else the machine, leaves. Pinned "
        "when the state fits, pageable when only that fits, else a synchronous save (0: always).")
    uri: str = Field(
        "checkpoints",
        description="Root of checkpoint folders; a run writes under <uri>/<dag_id>/<run_id>/. A "
        "local folder (relative to TRAINFORGE_HOME) or s3://bucket/prefix (manifest uploaded last).",
    )

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str) -> str:
        if _SCHEME.match(value) and not S3_URI.match(value):
            raise ValueError(f"checkpoint uri must be a local folder or an s3://bucket/prefix URI "
                             f"(got {value!r}; expected e.g. 'checkpoints' or "
                             f"'s3://my-bucket/checkpoints'; bucket: 3-63 lower-case letters, "
                             f"digits, '.' or '-')")
        return value


# The fields that come from the installed engines (trainforge.pipeline.engines): `engine`, then
# `resources`, then one block per engine, `training.<engine>`.
_EngineFields = create_model("_EngineFields", __base__=SpecModel, __module__=__name__,
                             engine=engine_field(),
                             resources=(ResourcesSection, ResourcesSection()),
                             **block_fields())


class TrainingSection(_EngineFields):  # type: ignore[valid-type, misc]
    optimization: OptimizationSection
    framework: FrameworkSection = FrameworkSection()
    checkpoint: CheckpointSection
    fault: FaultSection = FaultSection()
    peft: PeftSection | None = Field(
        None, description="LoRA adapters on model.pretrained: only they train, checkpoints hold them "
        "alone. null: every weight trains."
    )
    log_every_steps: int = Field(10, ge=1, description="Metric and log-line interval in steps.")

    @property
    def engine_block(self) -> SpecModel:
        """The settings block of the chosen engine (defaults when the block is omitted)."""
        return engine_block(self)

    @property
    def world_size(self) -> int:
        """Ranks at the job's most machines (an elastic job may go on with fewer)."""
        return self.resources.max_nodes * self.resources.processes_per_node

    @model_validator(mode="after")
    def _batch_and_interval(self) -> TrainingSection:
        errors = self._rules()
        if errors:
            raise field_errors(TrainingSection, *errors)
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _rules_despite_errors(cls, data, handler):
        # pydantic skips the rules above when any field is invalid. Each rule whose own inputs
        # are valid is still checked (e.g. a misplaced engine block next to a typo in
        # optimization); rules that read an invalid section stay silent rather than guess.
        try:
            return handler(data)
        except ValidationError as err:
            errors = err.errors()
            if not isinstance(data, dict):
                raise
            failed = {e["loc"][0] for e in errors if e["loc"]}
            values = {}
            for name, field in cls.model_fields.items():
                if name in failed or name not in data:
                    continue
                value, section = data[name], _section_class(field.annotation)
                if section is not None and value is not None:
                    try:
                        value = section.model_validate(value)
                    except ValidationError:
                        continue
                values[name] = value
            partial = cls.model_construct(**values)
            extra = partial._rules(lambda *names: all(
                n in values or (n not in failed and not cls.model_fields[n].is_required())
                for n in names))
            if not extra:
                raise
            raise ValidationError.from_exception_data(
                cls.__name__, rewrap([*errors, *field_errors(cls, *extra).errors()], ())
            ) from None

    def _rules(self, usable=lambda *names: True) -> list[tuple]:
        """Cross-field problems, as :func:`field_errors` entries; a rule is checked only when
        ``usable(*sections)`` says the fields it reads are valid."""
        errors = misplaced_blocks(self, usable)
        if usable("engine", "resources"):
            errors += size_errors(self)
        if usable("resources", "fault"):
            errors += elastic_fault_errors(self.resources, self.fault)
        if usable("framework", "resources", "engine", self.engine):
            errors += fp8_device_errors(self)
        if not usable("optimization"):
            return errors
        opt = self.optimization
        if usable("resources"):
            errors += batch_errors(opt, self.resources)
        if usable("checkpoint") and self.checkpoint.interval_steps > opt.max_steps:
            errors.append((("checkpoint", "interval_steps"), f"interval_steps must fit in "
                           f"optimization.max_steps (got {self.checkpoint.interval_steps} > "
                           f"{opt.max_steps})", self.checkpoint.interval_steps, ()))
        return errors


def _section_class(annotation: object) -> type[SpecModel] | None:
    """The spec section class of a field typed ``Section`` or ``Section | None``, else None."""
    import typing

    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, SpecModel):
            return candidate
    return None


def _storage_as_written(data: object, failed: list[tuple]) -> list[tuple]:
    """The storage rule on raw spec data, for URIs that have no error of their own."""
    if not isinstance(data, dict) or not isinstance(data.get("training"), dict):
        return []
    training = data["training"]
    section = data.get("data") if isinstance(data.get("data"), dict) else {}
    checkpoint = training.get("checkpoint") if isinstance(training.get("checkpoint"), dict) else {}
    output_uri = section.get("output_uri", DataSection.model_fields["output_uri"].default)
    checkpoint_uri = checkpoint.get("uri", CheckpointSection.model_fields["uri"].default)
    engine = training.get("engine")
    if not (isinstance(engine, str) and needs_s3(engine) and isinstance(output_uri, str)
            and isinstance(checkpoint_uri, str)):
        return []
    return [error for error in storage_errors(engine, output_uri, checkpoint_uri)
            if not any(loc[:len(error[0])] == error[0] or error[0][:len(loc)] == loc
                       for loc in failed)]


StageSpec = stage_model(TrainingSection)  # one entry of `stages` (operators/pipeline/stages.py)


class PipelineSpec(SpecModel):
    """One pipeline: data prep → training → checkpoint validation → model registration."""

    pipeline: PipelineSection
    data: DataSection
    model: ModelSection = ModelSection()
    training: TrainingSection
    validation: ValidationSection = ValidationSection()
    registry: RegistrySection
    cost: CostSection = CostSection()
    storage: StorageSection = StorageSection()
    stages: list[StageSpec] | None = Field(  # type: ignore[valid-type]
        None, min_length=1,
        description="Several training stages (docs/stages.md): continued pre-training then "
        "fine-tuning, or variants side by side. Each entry has name, depends_on, init_from and "
        "training (overrides deep-merged over the top-level training); its task id is "
        "train_<name>. Unset: one stage, task id train.",
    )

    @field_validator("stages", mode="wrap")
    @classmethod
    def _stages(cls, value, handler, info):
        # Declared after `training` and `data`: their validated values are in info.data (absent
        # when they are invalid themselves; their own errors are reported then).
        if value is not None:
            check_stages(value, StageSpec, info.data.get("training"), info.data.get("data"),
                         TrainingSection)
        return handler(value)

    @model_validator(mode="after")
    def _whole_spec_rules(self) -> PipelineSpec:
        # One validator, so that every rule is checked even when another one fails.
        errors = [*storage_errors(self.training.engine, self.data.output_uri,
                                  self.training.checkpoint.uri),
                  *self._s3_access(), *self._init_keeps_tokenizer(),
                  *pretrained_errors(self.model, self.data.tokenizer.source,
                                     self.training.engine, len(self.stages or ())),
                  *fine_tuning_errors(self.model, self.data.format, self.training.peft is not None,
                                     self.training.peft is not None and not self.training.peft.merge),
                  *fp8_token_errors(self.training, self.data.sequence_length),
                  *self._approval_needs_gate()]
        if errors:
            raise field_errors(PipelineSpec, *errors)
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _independent_rules(cls, data, handler):
        # pydantic runs a model's "after" rules only when every field is valid. The storage rule
        # needs only the engine and two URIs: when another error (e.g. a cluster engine's
        # missing image) stops the whole-model rules, it is still checked on the values as
        # written, so that every error of the file shows up at once.
        try:
            return handler(data)
        except ValidationError as err:
            errors = err.errors()
            extra = _storage_as_written(data, [tuple(e["loc"]) for e in errors])
            if not extra:
                raise
            raise ValidationError.from_exception_data(
                cls.__name__, rewrap([*errors, *field_errors(cls, *extra).errors()], ())
            ) from None

    def _s3_access(self) -> list[tuple]:
        # One endpoint for every S3 client; connection secrets only where they stay in memory.
        errors = []
        given = self.data.s3_endpoint_url
        if not same_endpoint(given, self.storage.endpoint_url):
            errors.append((("storage", "endpoint_url"), f"storage.endpoint_url and "
                           f"data.s3_endpoint_url name different S3 endpoints (got "
                           f"{self.storage.endpoint_url!r} and {given!r}; expected one of them, "
                           f"or the same URL in both)", self.storage.endpoint_url, ()))
        if self.storage.aws_conn_id is not None:
            from trainforge.pipeline.stages import resolve_stages

            engines = {stage.training.engine for stage in resolve_stages(self)}
            errors += connection_secret_errors(engines, self.storage.aws_conn_id)
        return errors

    @property
    def s3_endpoint_url(self) -> str | None:
        """The S3 endpoint the spec names (``storage.endpoint_url``, else
        ``data.s3_endpoint_url``), or None."""
        return self.storage.endpoint_url or self.data.s3_endpoint_url

    def _init_keeps_tokenizer(self) -> list[tuple]:
        # Continued training must see the token ids the registered model was trained on.
        init = self.model.init_from
        if init is not None and self.data.tokenizer.source != init:
            return [(
                ("data", "tokenizer", "source"), f"model.init_from continues {init}, so the "
                f"data must be encoded with its tokenizer (got data.tokenizer.source "
                f"{self.data.tokenizer.source!r}; expected {init!r})",
                self.data.tokenizer.source, ("model", "init_from"))]
        return []

    def _approval_needs_gate(self) -> list[tuple]:
        # A person approves what the gate passed, registry.eval scores for it: with the gate off neither is read.
        what = {"approval": "asks a person to approve each eval-gate pass", "eval": "adds a task score to the eval gate"}
        return [(("registry", key), f"registry.{key} {text}, but validation.gate.enabled is false, so champion "
                 f"never moves (got validation.gate.enabled false; expected true, or no registry.{key})",
                 False, ("validation", "gate", "enabled"))
                for key, text in what.items()
                if getattr(self.registry, key) is not None and not self.validation.gate.enabled]

    @property
    def dag_id(self) -> str:
        return self.pipeline.name

    @property
    def experiment_name(self) -> str:
        return self.pipeline.mlflow_experiment or self.pipeline.name
