"""Pipeline spec: the typed model, the YAML loader with positions, and schema export."""

from trainforge.pipeline.loader import SpecError, SpecIssue, load_spec, parse_spec_text, validate_overrides
from trainforge.pipeline.spec import PipelineSpec

__all__ = [
    "PipelineSpec",
    "SpecError",
    "SpecIssue",
    "load_spec",
    "parse_spec_text",
    "validate_overrides",
]
