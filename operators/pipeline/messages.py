"""How the spec loader words and places each problem: pydantic's errors turned into the
one-line form ``field.path: what is wrong (got X; expected Y)``, at the line and column of the
field (see :mod:`trainforge.pipeline.loader`, which records the positions).
"""

from __future__ import annotations

import re
from typing import Any

from trainforge.sections import BOOL_FOR_NUMBER, CROSS_FIELD, WrongScalar
from trainforge.pipeline.misplaced import MISPLACED
from trainforge.pipeline.spec import PipelineSpec

#: Prefix of the positions of keys in the loader's marks (``marks[KEY_MARK + path]``); a NUL
#: never appears in a YAML key, so no data path can collide with it.
KEY_MARK = ("\x00key",)
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "literal"}


def _is_tag(kept: list, part: Any, marks: dict) -> bool:
    """Whether ``part`` of a pydantic error location names a union member, not data."""
    return (tuple(kept + [part]) not in marks and isinstance(part, str)
            and (part[:1].isupper() or part in _TYPE_TAGS or "[" in part))


def _union_branch(loc: tuple, marks: dict) -> tuple[tuple, str] | None:
    """``(location of the union, member tag)`` of the first union member in ``loc``, or None."""
    kept: list = []
    for part in loc:
        if _is_tag(kept, part, marks):
            return tuple(kept), part
        kept.append(part)
    return None


#: How a union member's tag reads in "expected ...", in the order alternatives are listed.
_ALTERNATIVES = {"int": "number", "float": "number", "str": "string", "bool": "boolean"}
_ORDER = ["number", "string", "boolean", "mapping", "list"]


def _tag_shape(tag: str) -> str:
    """The YAML shape a union member takes: ``mapping``, ``list`` or ``scalar``."""
    if tag[:1].isupper() or tag.startswith("dict"):
        return "mapping"
    if tag.startswith(("list", "tuple", "set")):
        return "list"
    return "scalar"


def _value_shape(value: Any) -> str:
    return "mapping" if isinstance(value, dict) else "list" if isinstance(value, list) else "scalar"


def _shown(value: Any) -> str:
    """A value as "got ..." shows it: the shape of a structure, the repr of a scalar."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return repr(value) if len(repr(value)) <= 40 else "a list"
    return repr(value)


def _value_at(data: Any, loc: tuple) -> Any:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _one_error_per_union(errors: list[dict], data: Any, marks: dict) -> list[dict]:
    """Keep, of a value that no member of a union accepts, only what helps the author.

    pydantic reports one error per union member (``str | AssetSchedule`` given a mapping says
    "Input should be a valid string" besides the mapping's real problem). The members whose
    shape (mapping, list, scalar) matches the value's are kept; when none matches, or only
    scalar members failed on their type, the union becomes one error: "got a mapping; expected
    a number, string or boolean".
    """
    groups: dict[tuple, list[tuple[str, dict]]] = {}
    for error in errors:
        branch = _union_branch(tuple(error["loc"]), marks)
        if branch is not None:
            groups.setdefault(branch[0], []).append((branch[1], error))
    drop: set[int] = set()
    added: list[dict] = []
    for point, members in groups.items():
        tags = list(dict.fromkeys(tag for tag, _ in members))
        if len(tags) < 2:
            continue
        value = _value_at(data, point)
        fitting = [t for t in tags if _tag_shape(t) == _value_shape(value)]
        type_only = all(len(e["loc"]) == len(point) + 1 for t, e in members if t in fitting)
        if fitting and not (len(fitting) > 1 and type_only):
            drop.update(id(e) for t, e in members if t not in fitting)
            continue
        drop.update(id(e) for _, e in members)
        expected = {_ALTERNATIVES.get(t, _tag_shape(t) if _tag_shape(t) != "scalar" else
                                      f"value {t[len('literal['):-1]}" if t.startswith("literal[")
                                      else t) for t in tags}
        ordered = sorted(expected, key=lambda a: (_ORDER.index(a) if a in _ORDER else 9, a))
        listed = "a " + (", ".join(ordered[:-1]) + " or " if len(ordered) > 1 else "") + ordered[-1]
        added.append({"type": "union_shape", "loc": point, "input": value,
                      "msg": f"wrong kind of value (got {_shown(value)}; expected {listed})"})
    return [e for e in errors if id(e) not in drop] + added


def _data_loc(loc: tuple, marks: dict) -> tuple:
    """A pydantic error location without union-member tags (``str``, ``AssetSchedule``, ...)."""
    kept: list = []
    for part in loc:
        if not _is_tag(kept, part, marks):
            kept.append(part)
    return tuple(kept)


def _position(marks: dict, loc: tuple, error: dict | None = None) -> tuple[int, int]:
    """Line and column (1-based) of the deepest recorded prefix of a pydantic error location.

    A cross-field error (:func:`trainforge.sections.field_errors`) about a field the file does
    not write points at its ``fallback`` field instead (e.g. ``training.engine``).
    """
    ctx = (error or {}).get("ctx") or {}
    if error is not None and error.get("type") == CROSS_FIELD and loc not in marks:
        relative, fallback = ctx.get("relative_loc", ()), ctx.get("fallback", ())
        if fallback and tuple(loc[len(loc) - len(relative):]) == tuple(relative):
            mark = marks.get(tuple(loc[:len(loc) - len(relative)]) + tuple(fallback))
            if mark is not None:
                return mark.line + 1, mark.column + 1
    if error is not None and error.get("type") in ("extra_forbidden", MISPLACED):
        mark = marks.get(KEY_MARK + tuple(loc))  # an unknown key: at the key, not its value
        if mark is not None:
            return mark.line + 1, mark.column + 1
    for cut in range(len(loc), -1, -1):
        mark = marks.get(tuple(loc[:cut]))
        if mark is not None:
            return mark.line + 1, mark.column + 1
    return 1, 1


_YAML_BOOL_WORDS = {"yes", "no", "on", "off", "y", "n", "true", "false"}


def _model_at(loc: tuple):
    """The pydantic model class that holds the field at ``loc`` (a pydantic error location)."""
    import types
    import typing

    from pydantic import BaseModel

    model: Any = PipelineSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return None
        annotation = field.annotation
        candidates = [annotation]
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            candidates = list(typing.get_args(annotation))
        candidates += [a for c in list(candidates) for a in typing.get_args(c)]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if model is None:
            return None
    return model


def _did_you_mean(word: str, choices) -> str:
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _yaml_hint(raw: str | None, given: Any, kind: str = "string_type") -> str:
    """Why YAML may have produced ``given`` from the unquoted text ``raw``: text fields given a
    number or boolean, number fields given a boolean (``retries: yes``)."""
    if kind == BOOL_FOR_NUMBER and raw is not None and raw.lower() in _YAML_BOOL_WORDS:
        return (f"; YAML reads unquoted {raw!r} as the boolean {given}: write a number "
                f"(e.g. 1 or 0)")
    if raw is None or kind != "string_type" or given is None:
        return ""
    if isinstance(given, bool) and raw.lower() in _YAML_BOOL_WORDS:
        return f"; YAML reads unquoted {raw!r} as the boolean {given}: quote it ('{raw}') to keep text"
    if not isinstance(given, str) and not isinstance(given, (dict, list)):
        return (
            f"; YAML read the unquoted {raw!r} as {type(given).__name__} {given!r}: quote it to "
            f"keep it as text"
        )
    return ""


def _describe(error: dict, marks: dict | None = None) -> str:
    marks = marks or {}
    loc = tuple(error["loc"])
    raw = marks.get(("raw",) + loc)
    message = error["msg"]
    message = re.sub(r"^(Value error|Assertion failed), ", "", message)
    kind = error["type"]
    given = error.get("input")
    if kind in (CROSS_FIELD, "union_shape", MISPLACED):  # worded in full where it was raised
        return message
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        name = next((p for p in reversed(loc) if isinstance(p, str)), "")
        what = f"a mapping of {name} settings" if kind != "dict_type" and name else "a mapping"
        wrong = "the section is empty" if given is None else "not a mapping"
        return f"{wrong} (got {_shown(given)}; expected {what})"
    if isinstance(given, WrongScalar):  # a boolean for a number, or a non-boolean for a boolean
        kind = BOOL_FOR_NUMBER if given.expected == "number" else kind
        return given.message() + _yaml_hint(raw, given.value, kind)
    if kind == "extra_forbidden":
        model = _model_at(loc)
        allowed = sorted(model.model_fields) if model is not None else []
        hint = _did_you_mean(loc[-1], allowed)
        if not hint and allowed:
            hint = f"; expected one of: {', '.join(allowed)}"
        return f"unknown field (got {loc[-1]!r}{hint})"
    if kind == "missing":
        return "required field is missing"
    if kind == "literal_error":
        expected = (error.get("ctx") or {}).get("expected", "")
        choices = [c.strip().strip("'") for c in expected.replace(" or ", ", ").split(",")]
        hint = _did_you_mean(given, choices) if len(choices) > 1 else ""
        return f"unknown value (got {given!r}; expected {expected}{hint})"
    if kind.startswith("date_"):  # a quoted date pydantic cannot parse
        return f"not a valid date (got {given!r}; expected YYYY-MM-DD)"
    if "(got " in message:
        return message + _yaml_hint(raw, given, kind)
    if isinstance(given, dict):  # a section's own check says what it needs; a scalar's says what it got
        if kind.endswith(("_type", "_parsing")):
            return f"{message} (got a mapping: {_short(given)})"
        return message
    return f"{message} (got {_short(given)}{_yaml_hint(raw, given, kind)})"


def _short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters and its length when longer (a 400-digit number)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"
