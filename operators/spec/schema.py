"""The pipeline spec's published forms: JSON Schema for editors, a Markdown reference for people.

Both are generated from :class:`~operators.spec.model.PipelineSpec` and committed:

* ``operators/spec/pipeline.schema.json`` — point ``yaml-language-server`` at it;
* ``docs/spec-reference.md`` — one table row per field.

``make schema`` (``trainforge schema --write``) regenerates them; a test fails when either is stale.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from operators.spec.model import PipelineSpec

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = Path(__file__).resolve().parent / "pipeline.schema.json"
REFERENCE_PATH = ROOT / "docs" / "spec-reference.md"
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


def _type_name(annotation: Any) -> str:
    text = repr(annotation).replace("typing.", "")
    for noise in ("<class '", "'>", "operators.spec.durations."):
        text = text.replace(noise, "")
    if text == "datetime.date":
        return "date (YYYY-MM-DD)"
    if "DurationS" in text or "BeforeValidator(func=<function parse_duration" in text:
        return "duration"
    if text.startswith("Annotated[int") and "parse_duration" in text:
        return "duration"
    return text


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
        "boolean field accepts only `true` or `false`. Dates are `YYYY-MM-DD`.",
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    for path, type_name, default, description in _rows(PipelineSpec, ""):
        cells = [f"`{path}`", type_name.replace("|", "\\|"), default.replace("|", "\\|"),
                 description.replace("|", "\\|").replace("\n", " ")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_published() -> list[Path]:
    """Regenerate the committed schema and reference; returns the paths written."""
    SCHEMA_PATH.write_text(schema_text(), encoding="utf-8")
    REFERENCE_PATH.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE_PATH.write_text(reference_markdown(), encoding="utf-8")
    return [SCHEMA_PATH, REFERENCE_PATH]
