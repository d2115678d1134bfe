"""The checks of a spec's ``stages`` list as written: each entry's fields, unique names,
``depends_on`` and ``init_from`` naming declared stages, no dependency cycle, and every stage's
merged training section valid (see :mod:`trainforge.pipeline.stages` for what stages are).

Pure (pydantic only); errors are located relative to ``stages`` so the loader reports each at
its line.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from trainforge.pipeline.engines import needs_s3
from trainforge.pipeline.stages import merged_training


def _issue(loc: tuple, message: str, given: Any) -> InitErrorDetails:
    # The message is passed as context so that braces in it are never read as a template.
    return InitErrorDetails(type=PydanticCustomError("stage", "{message}", {"message": message}),
                            loc=loc, input=given)


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


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


def rewrap(errors: list[dict], prefix: tuple) -> list[InitErrorDetails]:
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
            issues += rewrap(err.errors(), (i,))
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
        return rewrap(err.errors(), (i, "training"))
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
