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
:class:`~trainforge.pipeline.model.TrainingSection` as a single-stage spec, errors pointing at the
stage. The leaves (stages no other stage depends on) are the candidates of
``validate_checkpoint``, which registers the best valid one by validation loss (docs/stages.md).

This module is pure (pydantic only): the override models are derived from the spec model, so
no field, bound or description is declared twice.
"""

from __future__ import annotations

import copy

import difflib
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from trainforge.pipeline.engines import needs_s3
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


# -- checks ------------------------------------------------------------------------------------
def _issue(loc: tuple, message: str, given: Any) -> InitErrorDetails:
    # The message is passed as context so that braces in it are never read as a template.
    return InitErrorDetails(type=PydanticCustomError("stage", "{message}", {"message": message}),
                            loc=loc, input=given)


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


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


def _cycles(stages: list) -> list[list[str]]:
    """Every dependency cycle found by a depth-first walk, each as ``[a, b, ..., a]`` where each
    stage depends on the next (self-dependencies included)."""
    deps: dict[str, list[str]] = {}
    for stage in stages:  # a duplicate name is reported on its own; the first one counts here
        deps.setdefault(stage.name, list(stage.depends_on))
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    path: list[str] = []
    found: list[list[str]] = []

    def walk(name: str) -> None:
        state[name] = 1
        path.append(name)
        for dep in deps.get(name, []):
            if dep not in deps:
                continue
            if state.get(dep) == 1:
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                walk(dep)
        path.pop()
        state[name] = 2

    for stage in stages:
        if stage.name not in state:
            walk(stage.name)
    return found


def _rewrap(errors: list[dict], prefix: tuple) -> list[InitErrorDetails]:
    """pydantic errors again, under ``prefix``: same type and context (the loader words and
    places errors by them), the message as pydantic wrote it."""
    return [InitErrorDetails(
        type=PydanticCustomError(e["type"], "{message}", {**(e.get("ctx") or {}), "message": e["msg"]}),
        loc=(*prefix, *e["loc"]), input=e.get("input")) for e in errors]


@dataclass(frozen=True)
class _Named:
    """What the graph checks need of a stage whose entry is otherwise invalid."""

    name: str
    depends_on: list[str]
    init_from: str | None


def _graph_view(raw: Any) -> _Named | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return None
    deps = raw.get("depends_on") or []
    init = raw.get("init_from")
    return _Named(raw["name"], [d for d in deps if isinstance(d, str)] if isinstance(deps, list)
                  else [], init if isinstance(init, str) else None)


def check_stages(raw_stages: Any, stage_cls: type[BaseModel], training: BaseModel | None,
                 data: BaseModel | None, training_section: type[BaseModel]) -> None:
    """Check the ``stages`` list as written; raises one ``ValidationError`` listing every problem.

    Locations are relative to ``stages`` (``(index, field, ...)``), so the spec loader reports
    each at its line. Every entry is checked even when others are invalid. ``training`` (the
    validated top-level section) is None when it is itself invalid: the merged sections are then
    not checked (its own errors are reported instead). Not a list: nothing to check here (the
    field's type reports it).

    Checks: each entry's fields; unique names; ``depends_on`` and ``init_from`` name declared
    stages (with a did-you-mean); ``init_from`` is among ``depends_on``; no dependency cycle
    (reported with its path); each merged training section is valid, and on Kubernetes reads and
    writes S3.
    """
    if not isinstance(raw_stages, list):
        return
    issues: list[InitErrorDetails] = []
    parsed: list[Any] = []
    stages: list[Any] = []  # parsed entries, or a graph view of an invalid one, or None
    for i, raw in enumerate(raw_stages):
        try:
            entry = stage_cls.model_validate(raw)
        except ValidationError as err:
            issues += _rewrap(err.errors(), (i,))
            entry = _without_unknown_keys(raw, err.errors(), stage_cls)
            parsed.append(entry)  # None: the merged rules would judge values known to be wrong
            stages.append(entry if entry is not None else _graph_view(raw))
        else:
            parsed.append(entry)
            stages.append(entry)
    indexed = [(i, s) for i, s in enumerate(stages) if s is not None]
    issues += _graph_issues(indexed)
    if training is not None:
        for i, stage in enumerate(parsed):
            if stage is not None:
                issues += _merged_issues(i, stage, training, data, training_section)
    if issues:
        raise ValidationError.from_exception_data("stages", issues)


def _without_unknown_keys(raw: Any, errors: list[dict], stage_cls: type[BaseModel]) -> Any:
    """The stage entry without its unknown keys, when they are its only errors (an unknown key
    changes no setting, so the rules on the merged section still say only true things), else
    None."""
    if any(e["type"] != "extra_forbidden" for e in errors):
        return None
    cleaned = copy.deepcopy(raw)
    for error in errors:
        node = cleaned
        *parents, last = error["loc"]
        try:
            for part in parents:
                node = node[part]
            del node[last]
        except (KeyError, IndexError, TypeError):
            return None
    try:
        return stage_cls.model_validate(cleaned)
    except ValidationError:
        return None


def _graph_issues(indexed: list[tuple[int, Any]]) -> list[InitErrorDetails]:
    issues: list[InitErrorDetails] = []
    names = list(dict.fromkeys(s.name for _, s in indexed))
    first: dict[str, int] = {}
    for i, stage in indexed:
        if stage.name in first:
            issues.append(_issue((i, "name"), f"duplicate stage name (got {stage.name!r}; already "
                                 f"the name of stages[{first[stage.name]}]; expected each stage "
                                 f"name once)", stage.name))
        else:
            first[stage.name] = i
    for i, stage in indexed:
        seen: set[str] = set()
        for j, dep in enumerate(stage.depends_on):
            if dep in seen:
                issues.append(_issue((i, "depends_on", j), f"listed twice (got {dep!r}; expected "
                                     f"each stage once)", dep))
            elif dep not in first:
                others = [n for n in names if n != stage.name]
                issues.append(_issue((i, "depends_on", j), f"unknown stage (got {dep!r}; "
                                     f"expected one of: {', '.join(others) or 'no other stage'}"
                                     f"{_did_you_mean(dep, others)})", dep))
            seen.add(dep)
        if stage.init_from is not None:
            if stage.init_from not in first:
                others = [n for n in names if n != stage.name]
                issues.append(_issue((i, "init_from"), f"unknown stage (got "
                                     f"{stage.init_from!r}; expected a stage of depends_on"
                                     f"{_did_you_mean(stage.init_from, others)})",
                                     stage.init_from))
            elif stage.init_from not in stage.depends_on:
                issues.append(_issue((i, "init_from"), f"init_from must be one of this stage's "
                                     f"depends_on (got {stage.init_from!r}; expected one of "
                                     f"{stage.depends_on or '[] (add it to depends_on)'})",
                                     stage.init_from))
    reported: set[frozenset] = set()
    by_index = dict(indexed)
    for cycle in _cycles([s for _, s in indexed]):
        key = frozenset(cycle)
        if key in reported:
            continue
        reported.add(key)
        i = first[cycle[0]]
        j = by_index[i].depends_on.index(cycle[1])
        issues.append(_issue((i, "depends_on", j), f"dependency cycle (got {' -> '.join(cycle)}, "
                             f"each stage depending on the next; expected stages without a "
                             f"cycle: remove one of these depends_on entries)", cycle[1]))
    return issues


def _merged_issues(i: int, stage: Any, training: BaseModel, data: BaseModel | None,
                   training_section: type[BaseModel]) -> list[InitErrorDetails]:
    """Problems of stage ``i``'s merged training section (top-level training + overrides)."""
    try:
        section = training_section.model_validate(merged_training(training, stage))
    except ValidationError as err:
        return _rewrap(err.errors(), (i, "training"))
    issues = []
    if needs_s3(section.engine) and data is not None:
        for field, value in (("data.output_uri", data.output_uri),
                             ("checkpoint.uri", section.checkpoint.uri)):
            if not value.startswith("s3://"):
                issues += [_issue(
                    (i, "training", "engine"),
                    f"{field} must be an s3:// URI for a stage on the {section.engine} engine, "
                    f"where every node can read it (got {value!r}; expected e.g. 's3://bucket/prefix')",
                    section.engine)]
    return issues


# -- the stages of a validated spec ------------------------------------------------------------
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
