"""Keys written in the wrong section: ``name:`` and ``schedule:`` beside ``pipeline:`` instead of
under it, ``max_steps:`` directly under ``training:``.

pydantic sees an unknown field where the key is and a missing one where it belongs, and says
both: "unknown field" without a hint, then "required field is missing" (or "the section is
empty") for the section the key was meant for. Here each such key becomes one line, "did you
mean pipeline.schedule?", and the missing-field errors the misplaced keys explain are dropped.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

from pydantic import BaseModel

from trainforge.pipeline.errors import dotted

#: pydantic error type of a key that belongs elsewhere (worded in full by :func:`explain`).
MISPLACED = "misplaced"


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The spec models a field holds directly (``Section``, ``Section | None``, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) in (
            typing.Union, typing.Annotated):
        return [m for a in typing.get_args(annotation) for m in _models(a)]
    return []


@functools.lru_cache(maxsize=None)
def _field_paths(model: type[BaseModel]) -> tuple[tuple[str, ...], ...]:
    """Every field path of ``model``, sections included, not descending into lists."""
    paths: list[tuple[str, ...]] = []
    for name, field in model.model_fields.items():
        paths.append((name,))
        for sub in _models(field.annotation):
            paths += [(name, *rest) for rest in _field_paths(sub) if (name, *rest) not in paths]
    return tuple(paths)


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model of the section at ``loc`` (list indexes pass into the list's item model)."""
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        if typing.get_origin(annotation) is list or (
                isinstance(annotation, types.UnionType) and any(
                    typing.get_origin(a) is list for a in typing.get_args(annotation))):
            items = [a for a in (annotation, *typing.get_args(annotation))
                     if typing.get_origin(a) is list]
            annotation = typing.get_args(items[0])[0] if items else annotation
        found = _models(annotation)
        if not found:
            return None
        model = found[0]
    return model


def _required(root: type[BaseModel], loc: tuple) -> set[str]:
    model = _model_at(root, loc)
    if model is None:
        return set()
    return {n for n, f in model.model_fields.items() if f.is_required()}


def _written(data: Any, path: tuple) -> bool:
    """Whether the spec data has a value at ``path``."""
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return False
    return True


def _targets(root: type[BaseModel], loc: tuple, wanted: set[tuple], data: Any) -> list[tuple]:
    """Where the unknown key at ``loc`` is a field not written yet: searched from its own
    section outwards, the nearest section with a match wins; among its matches, those a
    missing-field error asks for come first, then the shallowest."""
    key = loc[-1]
    for cut in range(len(loc) - 1, -1, -1):
        base = loc[:cut]
        model = _model_at(root, base)
        if model is None:
            continue
        found = [base + path for path in _field_paths(model)
                 if path[-1] == key and base + path != loc and not _written(data, base + path)]
        if found:
            def rank(path: tuple) -> tuple:
                asked = any(path[:n] in wanted for n in range(len(path), 0, -1))
                return (not asked, len(path))

            best = min(rank(p) for p in found)
            return sorted(p for p in found if rank(p) == best)
    return []


def explain(errors: list[dict], root: type[BaseModel], data: Any) -> list[dict]:
    """``errors`` (pydantic's, with data locations, for the spec ``data``) with each unknown
    key that is a field of another section, not written there, reworded as one "did you mean" error, and the "required field is missing"
    and "the section is empty" errors those keys explain removed."""
    wanted = {tuple(e["loc"]) for e in errors if e["type"] == "missing"
              or (e["type"] in ("model_type", "model_attributes_type") and e.get("input") is None)}
    moved: dict[tuple, list[str]] = {}  # section -> the keys meant for it
    out = []
    for error in errors:
        loc = tuple(error["loc"])
        if error["type"] != "extra_forbidden" or not loc or not isinstance(loc[-1], str):
            out.append(error)
            continue
        targets = _targets(root, loc, wanted, data)
        if not targets:
            out.append(error)
            continue
        for target in targets:
            moved.setdefault(target[:-1], []).append(target[-1])
        where = "at the top level" if len(loc) == 1 else f"in {dotted(loc[:-1])}"
        names = " or ".join(dotted(t) for t in targets[:3])
        under = dotted(targets[0][:-1])
        advice = f"move it under {under}:" if under else "move it to the top level"
        out.append({**error, "type": MISPLACED,
                    "msg": f"unknown field {where} (got {loc[-1]!r}; did you mean {names}? "
                           f"{advice})"})

    def explained(error: dict) -> bool:
        loc = tuple(error["loc"])
        if loc not in wanted or not loc:
            return False
        if loc[-1] in moved.get(loc[:-1], ()):
            return True  # the key itself, written elsewhere
        # a missing or empty section: explained when keys meant for it give all it requires
        meant = any(section[:len(loc)] == loc for section in moved)
        return meant and _required(root, loc) <= set(moved.get(loc, ()))

    return [e for e in out if not explained(e)]
