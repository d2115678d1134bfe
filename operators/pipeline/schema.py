"""The pipeline spec's published forms: JSON Schema for editors, a Markdown reference for people.

Both are generated from :class:`~trainforge.pipeline.spec.PipelineSpec` and committed:

* ``operators/pipeline/pipeline.schema.json`` — point ``yaml-language-server`` at it;
* ``docs/spec-reference.md`` — one table row per field.

``make schema`` (``trainforge schema --write``) regenerates them; a test fails when either is stale.
"""

from __future__ import annotations

import datetime
import json
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from trainforge.pipeline.spec import PipelineSpec

SCHEMA_PATH = Path(__file__).resolve().parent / "pipeline.schema.json"
"""The schema shipped inside the package (``trainforge schema`` prints it)."""
# Where the committed copies live in a checkout, relative to its root.
CHECKOUT_SCHEMA = Path("operators") / "pipeline" / "pipeline.schema.json"
CHECKOUT_REFERENCE = Path("docs") / "spec-reference.md"
SCHEMA_ID = "https://trainforge.dev/schemas/pipeline.schema.json"


def json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a pipeline spec file."""
    schema = PipelineSpec.model_json_schema(mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "trainforge pipeline",
        **{k: v for k, v in schema.items() if k != "title"},
    }


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=False) + "\n"


def _submodel(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        candidates = list(typing.get_args(annotation))
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _inner(annotation: Any) -> str:
    """``_type_name`` in parentheses when it lists alternatives (inside list/mapping types)."""
    text = _type_name(annotation)
    return f"({text})" if " or " in text else text


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean",
            type(None): "null", datetime.date: "date (YYYY-MM-DD)"}


def _type_name(annotation: Any) -> str:
    """A field's type as people read it: ``list of string``, ``string or null``,
    ``list of mappings (key, operator, value, effect)``; no Python module paths."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        if any("parse_duration" in repr(m) for m in args[1:]):
            return "duration"
        return _type_name(args[0])
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if isinstance(annotation, types.UnionType) or origin is typing.Union:
        # A one-value Literal among alternatives reads as the value: 'auto' or boolean.
        return " or ".join(dict.fromkeys(
            repr(typing.get_args(a)[0]) if typing.get_origin(a) is typing.Literal
            and len(typing.get_args(a)) == 1 else _type_name(a) for a in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple, set, frozenset):
        item = args[0] if args else Any
        if isinstance(item, type) and issubclass(item, BaseModel):
            return f"list of mappings ({', '.join(item.model_fields)})"
        if typing.get_origin(item) is typing.Literal:
            return "list, each " + _type_name(item)
        return f"list of {_inner(item)}"
    if origin is dict:
        return f"mapping of {_inner(args[0])} to {_inner(args[1])}" if args else "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"mapping ({', '.join(annotation.model_fields)})"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", repr(annotation))


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = _submodel(field.annotation)
        if sub is not None:
            rows.append((path, "section", "required" if field.is_required() else "", field.description or sub.__doc__ or ""))
            rows += _rows(sub, path + ".")
            continue
        is_duration = any("parse_duration" in repr(m) for m in field.metadata)
        type_name = "duration" if is_duration else _type_name(field.annotation)
        if field.is_required():
            default = "required"
        elif field.default_factory is not None:
            default = json.dumps(field.default_factory())
        else:
            default = json.dumps(field.default, default=str)
        bounds = []
        for meta in field.metadata:
            for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if getattr(meta, attr, None) is not None:
                    bounds.append(f"{sign} {getattr(meta, attr)}")
        description = (field.description or "") + (f" ({', '.join(bounds)})" if bounds else "")
        rows.append((path, type_name, default, description))
    return rows


def reference_markdown() -> str:
    """A Markdown table of every field: path, type, default, description with bounds."""
    lines = [
        "# Pipeline spec reference",
        "",
        "Generated from the spec model by `make schema`; do not edit by hand.",
        "Durations are strings such as `30s`, `15m`, `2h`, `1h30m`. Relative paths resolve",
        "against `TRAINFORGE_HOME`. Every section rejects unknown keys. Booleans and numbers",
        "never stand in for each other: a number field refuses `yes`/`no`/`on`/`off`/`true`, a",
        "boolean field accepts only `true` or `false`; a quoted number (`\"300\"`) is text, not a",
        "number. Keys are text: quote a key YAML reads otherwise (`\"on\":`). Dates are `YYYY-MM-DD`.",
        "A duration is longer than zero, except `retry_delay`, which may be `0s` (retry at once).",
        "Quote a value that starts with `*` (`'*/5 * * * *'`): unquoted, YAML reads it as an alias.",
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    for path, type_name, default, description in _rows(PipelineSpec, ""):
        cells = [f"`{path}`", type_name.replace("|", "\\|"), default.replace("|", "\\|"),
                 description.replace("|", "\\|").replace("\n", " ")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_published(checkout: Path) -> list[Path]:
    """Regenerate the committed schema and reference in ``checkout``; returns the paths written.

    Raises:
        FileNotFoundError: ``checkout`` is not a trainforge checkout (no ``operators/pipeline``).
    """
    schema_path, reference_path = checkout / CHECKOUT_SCHEMA, checkout / CHECKOUT_REFERENCE
    if not schema_path.parent.is_dir():
        raise FileNotFoundError(
            f"{checkout} is not a trainforge checkout: {CHECKOUT_SCHEMA.parent} is missing "
            "(run `trainforge schema --write` from the checkout's root)")
    schema_path.write_text(schema_text(), encoding="utf-8")
    reference_path.parent.mkdir(parents=True, exist_ok=True)
    reference_path.write_text(reference_markdown(), encoding="utf-8")
    return [schema_path, reference_path]
