"""The published JSON Schema and reference are current, and agree with the model."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from trainforge.pipeline import schema as published
from trainforge.pipeline.yaml_positions import SpecLoader

ROOT = Path(__file__).resolve().parents[3]
PIPELINES = sorted((ROOT / "dags" / "pipelines").glob("*.yaml"))


def test_committed_schema_is_current():
    assert (ROOT / published.CHECKOUT_SCHEMA).read_text() == published.schema_text(), (
        "operators/pipeline/pipeline.schema.json is stale: run `make schema`")


def test_committed_reference_is_current():
    assert (ROOT / published.CHECKOUT_REFERENCE).read_text() == published.reference_markdown(), (
        "docs/spec-reference.md is stale: run `make schema`")


def _load(path: Path):
    """The file as an editor's YAML language server sees it (dates stay ISO strings)."""
    data = yaml.load(path.read_text(), Loader=SpecLoader)  # noqa: S506 - our SafeLoader subclass

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value.isoformat() if hasattr(value, "isoformat") else value

    return plain(data)


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_example_pipelines_validate_against_the_json_schema(path):
    jsonschema.validate(_load(path), published.json_schema())


def test_json_schema_rejects_what_the_model_rejects():
    data = _load(PIPELINES[0])
    data["training"]["optimisation"] = data["training"].pop("optimization")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, published.json_schema())


@pytest.mark.parametrize(("value", "valid"), [
    ("auto", True), (True, True), (False, True), ("yes-please", False), ("true", False), (1, False),
])
def test_json_schema_takes_framework_compile_as_the_model_does(value, valid):
    data = _load(PIPELINES[0])
    data["training"].setdefault("framework", {})["compile"] = value
    if valid:
        jsonschema.validate(data, published.json_schema())
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(data, published.json_schema())


def test_reference_shows_readable_types():
    text = published.reference_markdown()
    assert "trainforge.pipeline" not in text and "Literal[" not in text
    assert "| `training.kubernetes.tolerations` | list of mappings (key, operator, value, effect) |" in text
    assert "| `stages` | list of mappings (name, depends_on, init_from, training) or null |" in text
    assert "| `pipeline.tags` | list of string |" in text
    assert "| `training.framework.compile` | 'auto' or boolean | \"auto\" |" in text
