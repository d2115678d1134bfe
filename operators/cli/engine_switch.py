"""A spec switched to another engine: what ``trainforge render --engine`` and
``trainforge run --engine`` build before they render or run it.

No Airflow, no engine client: pydantic, and YAML for the derived spec file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from trainforge.engines.descriptors import engine_names, get_engine
from trainforge.pipeline.spec import PipelineSpec

# What `render --engine E` fills in when the spec was written for another engine and E needs
# it: a container image for an engine that runs one, S3 locations for an engine without a
# disk shared with the orchestrator. Shown on stderr, never silently: the request printed is
# what that spec *would* send once the user sets these fields.
IMAGE_PLACEHOLDER = "registry.example.com/trainforge-trainer:0.1.0"
S3_PLACEHOLDERS = {
    ("data", "output_uri"): "s3://your-bucket/datasets",
    ("training", "checkpoint", "uri"): "s3://your-bucket/checkpoints",
}


def engine_placeholders(engine: str) -> dict[tuple[str, ...], str]:
    """The placeholders ``engine`` needs, from its declared capabilities."""
    descriptor = get_engine(engine)
    placeholders = {}
    if descriptor.needs_image:
        placeholders[("training", "resources", "image")] = IMAGE_PLACEHOLDER
    if not descriptor.shared_disk:
        placeholders.update(S3_PLACEHOLDERS)
    return placeholders


def for_engine(spec: PipelineSpec, engine: str) -> tuple[PipelineSpec, list[str]]:
    """``spec`` re-validated with ``training.engine`` set to ``engine``.

    Other engines' blocks are dropped; fields the engine needs but the spec lacks get the
    placeholders of :func:`engine_placeholders`. Returns the spec and one line per placeholder
    used. Raises pydantic's ``ValidationError`` if the spec still does not fit the engine.
    """
    if engine == spec.training.engine:
        return spec, []
    raw = spec.model_dump(mode="json")
    raw["training"]["engine"] = engine
    for block in engine_names():
        if block != engine:
            raw["training"].pop(block, None)
    used = []
    for path, value in engine_placeholders(engine).items():
        *parents, leaf = path
        node = raw
        for key in parents:
            node = node[key]
        current = node.get(leaf)
        if current is None or (path[-1] in ("output_uri", "uri")
                               and not str(current).startswith("s3://")):
            node[leaf] = value
            used.append(f"{'.'.join(path)}: {value}")
    pretrained = (raw.get("model") or {}).get("pretrained")
    if (pretrained and not get_engine(engine).shared_disk
            and not pretrained.startswith(("s3://", "models:/"))):  # the ranks cannot read this disk
        name = pretrained.rstrip("/").rsplit("/", 1)[-1].split("@")[0]
        raw["model"]["pretrained"] = f"s3://your-bucket/models/{name}/"
        used.append(f"model.pretrained: {raw['model']['pretrained']} (a copy of {pretrained})")
    return PipelineSpec.model_validate(raw), used


def derived_spec(spec: PipelineSpec, engine: str,
                 block_values: dict[str, Any] | None = None) -> PipelineSpec:
    """``spec`` with ``training.engine`` switched to ``engine``, and ``block_values`` set in its
    block (``training.<engine>``: e.g. the address of a development cluster started for the run).

    Raises:
        ValueError: the spec does not fit the engine without made-up values (e.g. the
            kubernetes engine needs a container image the spec does not name).
    """
    switched, placeholders = for_engine(spec, engine)
    if placeholders:
        raise ValueError(f"the spec lacks what engine {engine!r} needs: "
                         f"{'; '.join(placeholders)} (set these fields in the spec)")
    if block_values:
        raw = switched.model_dump(mode="json")
        raw["training"][engine] = {**(raw["training"].get(engine) or {}), **block_values}
        switched = PipelineSpec.model_validate(raw)
    return switched


def write_spec(spec: PipelineSpec, path: Path) -> Path:
    """Write ``spec`` as YAML to ``path`` (atomically); the loader reads it back unchanged."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = spec.model_dump(mode="json")
    for key in ("approval", "eval"):  # in a file, an empty approval or eval key is an error
        if key in raw["registry"] and raw["registry"][key] is None:
            del raw["registry"][key]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("# Derived by `trainforge run --engine`; edit the original spec instead.\n"
                   + yaml.safe_dump(raw, sort_keys=False))
    os.replace(tmp, path)
    return path
