"""Training stages: more than one training task in one pipeline.

A spec without ``stages`` has one training task, ``train``, configured by ``training``. A spec
with ``stages`` has one training task per stage, ``train_<name>``, wired by ``depends_on``::

    stages:
      - name: pretrain
        training: {optimization: {max_steps: 2000}}
      - name: finetune
        depends_on: [pretrain]
        init_from: pretrain            # weights only: fresh optimizer, schedule and step count
        training: {optimization: {max_steps: 200, learning_rate: 1e-4}}

Each stage's ``training`` block holds overrides only: it is deep-merged over the top-level
``training`` (mappings merge key by key; a scalar or a list replaces the inherited value; an
unset or ``null`` key inherits) and the merged result is validated by the same
:class:`~trainforge.pipeline.spec.TrainingSection` as a single-stage spec, errors pointing at the
stage. The leaves (stages no other stage depends on) are the candidates of
``validate_checkpoint``, which registers the best valid one by validation loss (docs/stages.md).

This module is pure (pydantic only): the override models are derived from the spec model, so
no field, bound or description is declared twice.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
)

from trainforge.sections import SpecModel, check_length

# A stage name becomes part of a task id (`train_<name>`) and of a checkpoint folder.
STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
SINGLE_TASK_ID = "train"


def stage_task_id(name: str | None) -> str:
    """The training task id of stage ``name``; ``train`` for the single-stage form (None)."""
    return f"{SINGLE_TASK_ID}_{name}" if name else SINGLE_TASK_ID


def stage_folder(checkpoint_root: str, name: str | None) -> str:
    """The checkpoint folder of stage ``name`` under a DAG run's root (the root itself for the
    single-stage form). Joined with ``/`` so that ``s3://`` roots work alike."""
    return f"{checkpoint_root.rstrip('/')}/{name}" if name else checkpoint_root


def stage_init_from(spec, name: str | None) -> str | None:
    """The ``init_from`` of stage ``name`` of a validated spec (None: none, or no stages)."""
    return next((s.init_from for s in spec.stages or [] if s.name == name), None)


# -- override models ---------------------------------------------------------------------------
def _optional(annotation: Any) -> Any:
    """``annotation`` with every spec section in it replaced by its overrides model."""
    if isinstance(annotation, type) and issubclass(annotation, SpecModel):
        return overrides_model(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = tuple(_optional(a) for a in typing.get_args(annotation))
        return typing.Union[args]  # noqa: UP007 - built from a runtime tuple
    return annotation


class _Overrides(SpecModel):
    """Base of the generated override models: unset (None) fields are left out when dumped, so a
    dumped spec carries only what its author wrote and reloads to the same merge."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        # Replaces SpecModel's check of the same name: None means "inherit" here (SpecModel
        # refuses None in a `bool | None` field); any other value gets SpecModel's check as the
        # section's own field would (the kind of field is read from the section).
        if value is None:
            return value
        parent = SpecModel.__pydantic_decorators__.field_validators.get("_no_bool_for_number")
        return parent.func.__func__(_SOURCE[cls], value, info) if parent else value

    @model_serializer(mode="wrap")
    def _only_set(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


_OVERRIDES: dict[type, type] = {}  # section -> its overrides model
_SOURCE: dict[type, type] = {}  # overrides model -> its section


def overrides_model(section: type[SpecModel]) -> type[SpecModel]:
    """A model with the fields of ``section``, every one optional (None = inherit), nested
    sections again as override models. Bounds and descriptions are those of ``section``;
    cross-field rules are not (they are checked on the merged result)."""
    if section in _OVERRIDES:
        return _OVERRIDES[section]
    fields: dict[str, Any] = {}
    for name, info in section.model_fields.items():
        # Field metadata (bounds, the duration parser) applies to the value when one is given.
        inner = _optional(info.annotation)
        if info.metadata:
            inner = Annotated[(inner, *info.metadata)]
        fields[name] = (inner | None, Field(None, description=info.description))
    model = create_model(
        f"{section.__name__}Overrides", __base__=_Overrides, __module__=__name__,
        __doc__=f"Overrides of {section.__name__}; unset fields inherit the top-level value.",
        **fields,
    )
    _OVERRIDES[section], _SOURCE[model] = model, section
    return model


def stage_model(training_section: type[SpecModel]) -> type[SpecModel]:
    """The model of one entry of ``stages``, its ``training`` typed by ``training_section``."""
    overrides = overrides_model(training_section)

    class Stage(SpecModel):
        """One training stage: its own training task, after the stages it depends on."""

        name: str = Field(
            description="Stage name (lowercase letters, digits, '_'); its task id is "
            "train_<name> and its checkpoints go to <checkpoint uri>/<dag_id>/<run_id>/<name>/.",
        )
        depends_on: list[str] = Field(
            default_factory=list,
            description="Stages that must finish first; none: the stage starts after prepare_data.",
        )
        init_from: str | None = Field(
            None,
            description="A stage of depends_on whose final checkpoint's weights this stage "
            "starts from (weights only: fresh optimizer, schedule and step count).",
        )
        training: overrides = Field(  # type: ignore[valid-type]
            default_factory=overrides,
            description="Overrides deep-merged over the top-level training section.",
        )

        @field_validator("name")
        @classmethod
        def _name(cls, value: str) -> str:
            check_length(value, 63, "a stage name")
            if not STAGE_NAME.match(value):
                raise ValueError(f"not a valid stage name (got {value!r}; expected lowercase "
                                 f"letters, digits and '_', starting with a letter, at most 63 "
                                 f"characters)")
            return value

    Stage.__qualname__ = "Stage"  # as if declared at module level (schema and reference names)
    return Stage


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in: mappings key by key, anything else replaced."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def merged_training(training: BaseModel, stage: BaseModel) -> dict[str, Any]:
    """The stage's training section as plain data: top-level training with its overrides."""
    return deep_merge(training.model_dump(mode="json"), stage.training.model_dump(mode="json"))


@dataclass(frozen=True)
class ResolvedStage:
    """One training task of a validated spec: its settings and its place in the graph."""

    name: str | None  # None: the single-stage form (no `stages`)
    task_id: str  # "train" or "train_<name>"
    depends_on: tuple[str, ...]
    init_from: str | None
    training: Any  # the merged, validated TrainingSection

    @property
    def init_task_id(self) -> str | None:
        """Task id of the stage whose final checkpoint this stage starts from."""
        return stage_task_id(self.init_from) if self.init_from else None


def resolve_stages(spec) -> list[ResolvedStage]:
    """The training stages of a validated ``PipelineSpec``, dependencies before dependants
    (declaration order among stages that are free to run). One ``train`` stage without
    ``stages``."""
    if not spec.stages:
        return [ResolvedStage(None, SINGLE_TASK_ID, (), None, spec.training)]
    by_name = {s.name: s for s in spec.stages}
    section = type(spec.training)
    done: list[str] = []
    pending = [s.name for s in spec.stages]
    while pending:  # validation ruled out cycles, so every round places at least one stage
        ready = [n for n in pending if all(d in done for d in by_name[n].depends_on)]
        done += ready
        pending = [n for n in pending if n not in ready]
    return [
        ResolvedStage(n, stage_task_id(n), tuple(by_name[n].depends_on), by_name[n].init_from,
                      section.model_validate(merged_training(spec.training, by_name[n])))
        for n in done
    ]


def leaf_stages(stages: list[ResolvedStage]) -> list[ResolvedStage]:
    """The stages no other stage depends on: their final checkpoints are the candidates."""
    needed = {d for s in stages for d in s.depends_on}
    return [s for s in stages if s.name not in needed]


def stage_spec(spec, name: str | None):
    """``spec`` as the stage ``name`` sees it: ``training`` is that stage's merged section (so
    every consumer of ``spec.training`` works unchanged). ``spec`` itself for None.

    Raises:
        KeyError: no stage has that name.
    """
    if name is None:
        return spec
    for stage in resolve_stages(spec):
        if stage.name == name:
            return spec.model_copy(update={"training": stage.training})
    raise KeyError(f"no stage named {name!r} in pipeline {spec.dag_id!r} "
                   f"(stages: {', '.join(s.name for s in spec.stages or [])})")
