"""Spec loading: valid files, and one row per kind of mistake (error type, field, line, text)."""

from __future__ import annotations

from pathlib import Path

import pytest

from operators.spec import SpecError, load_spec, parse_spec_text, validate_overrides

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"

MINIMAL = """\
pipeline:
  name: tiny
data:
  sources: [corpus/*.txt]
training:
  optimization:
    max_steps: 10
    global_batch_size: 4
    micro_batch_size: 2
    learning_rate: 1e-3
  checkpoint:
    interval_steps: 5
registry:
  model_name: tiny-llm
"""


def test_demo_spec_is_valid():
    spec = load_spec(DEMO)
    assert spec.dag_id == "shakespeare_llm"
    assert spec.training.world_size == 2
    assert spec.training.optimization.learning_rate == pytest.approx(3e-3)


def test_minimal_spec_takes_documented_defaults():
    spec = parse_spec_text(MINIMAL, "tiny.yaml")
    assert spec.training.optimization.learning_rate == pytest.approx(1e-3)
    assert isinstance(spec.training.optimization.learning_rate, float)
    assert spec.training.fault.run_timeout == 6 * 3600
    assert spec.registry.aliases == ["challenger"]
    assert spec.model.resolved_intermediate_size == 704  # 8/3 * 256 rounded up to 64


def _replace(old: str, new: str) -> str:
    assert old in MINIMAL
    return MINIMAL.replace(old, new)


CASES = [
    # (yaml text, field path, line, message fragment)
    (
        _replace("learning_rate: 1e-3", "learnin_rate: 1e-3"),
        "training.optimization.learnin_rate",
        10,
        "unknown field",
    ),
    (
        _replace("learning_rate: 1e-3", "learning_rate: fast"),
        "training.optimization.learning_rate",
        10,
        "got 'fast'",
    ),
    (
        _replace("  name: tiny\n", "  name: tiny\n  retry_delay: 30\n"),
        "pipeline.retry_delay",
        3,
        "got 30",
    ),
    (
        _replace("  name: tiny\n", "  name: tiny\n  retry_delay: 5 minutes\n"),
        "pipeline.retry_delay",
        3,
        "not a duration",
    ),
    (
        _replace("  name: tiny\n", "  name: tiny\n  schedule: every monday\n"),
        "pipeline.schedule",
        3,
        "not a valid cron expression",
    ),
    (
        _replace("  name: tiny\n", "  name: tiny\n  schedule: '@fortnightly'\n"),
        "pipeline.schedule",
        3,
        "unknown schedule preset",
    ),
    (_replace("name: tiny", "name: tiny llm"), "pipeline.name", 2, "not a valid dag_id"),
    (
        _replace("global_batch_size: 4", "global_batch_size: 6"),
        "training",
        5,
        "divisible by micro_batch_size x world size",
    ),
    (
        _replace("interval_steps: 5", "interval_steps: 50"),
        "training",
        5,
        "must fit in optimization.max_steps",
    ),
    (
        _replace("max_steps: 10", "max_steps: 0"),
        "training.optimization.max_steps",
        7,
        "greater than or equal to 1",
    ),
    (
        _replace("model_name: tiny-llm", "model_name: tiny-llm\n  aliases: [latest]"),
        "registry.aliases",
        15,
        "not a valid MLflow alias",
    ),
    (
        _replace("registry:\n  model_name: tiny-llm\n", ""),
        "registry",
        1,
        "required field is missing",
    ),
    (
        _replace("  name: tiny\n", "  name: tiny\n  name: other\n"),
        "pipeline.name",
        3,
        "duplicate key",
    ),
    (_replace("  name: tiny\n", "  name: tiny\n\tdescription: x\n"), "", 3, "tabs"),
    (
        _replace(
            "  checkpoint:\n    interval_steps: 5\n",
            "  checkpoint:\n    interval_steps: 5\n    keep_last: 0\n",
        ),
        "training.checkpoint.keep_last",
        13,
        "greater than or equal to 1",
    ),
]


@pytest.mark.parametrize("text,path,line,fragment", CASES)
def test_invalid_specs_point_at_the_field_and_line(text, path, line, fragment):
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    issues = info.value.issues
    match = [i for i in issues if i.path == path]
    assert match, f"no issue at {path!r}: {[str(i) for i in issues]}"
    assert match[0].line == line, str(match[0])
    assert fragment in match[0].message, str(match[0])
    assert str(match[0]).startswith(f"bad.yaml:{line}:")


def test_all_errors_of_a_file_are_reported_at_once():
    text = _replace("learning_rate: 1e-3", "learnin_rate: 1e-3").replace(
        "max_steps: 10", "max_steps: -1"
    )
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    paths = {i.path for i in info.value.issues}
    assert {"training.optimization.learnin_rate", "training.optimization.max_steps"} <= paths


def test_overrides_are_validated_by_the_same_model():
    spec = parse_spec_text(MINIMAL)
    assert (
        validate_overrides(
            spec, {"training.optimization.max_steps": 20}
        ).training.optimization.max_steps
        == 20
    )
    with pytest.raises(SpecError, match="max_steps"):
        validate_overrides(spec, {"training.optimization.max_steps": 0})
    with pytest.raises(SpecError, match="unknown field"):
        validate_overrides(spec, {"training.optimization.max_stepz": 3})
