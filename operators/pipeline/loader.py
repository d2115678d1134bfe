"""Read a pipeline YAML file into a :class:`~trainforge.pipeline.spec.PipelineSpec`.

Every problem is reported at once, one line each, in the form
``file:line:col: field.path: what is wrong (got X; expected Y)``. A valid file takes a fast path
(libyaml straight to plain data, one validation); anything wrong is read again by
:mod:`trainforge.pipeline.yaml_positions`, which keeps every node's position and lists the YAML
pitfalls it reports. Valid specs can be cached as validated JSON (:func:`enable_cache`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainforge.pipeline.errors import SpecError, SpecIssue, dotted
from trainforge.pipeline.messages import _describe
from trainforge.pipeline.spec import PipelineSpec
from trainforge.pipeline.registry import SPEC_FILE
from trainforge.pipeline.yaml_positions import SpecLoader, parse_with_positions
from trainforge.pipeline.yaml_syntax import path_at


class _DuplicateKey(Exception):
    """Raised by the fast path; the careful path reports it with positions."""


class _FastLoader(SpecLoader):
    """The happy path: libyaml straight to Python data, refusing duplicate keys."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=True) for k, _ in node.value]
        if len(keys) != len(set(map(repr, keys))):
            raise _DuplicateKey
        return super().construct_mapping(node, deep=deep)


def _first_alias(text: str) -> yaml.AliasEvent | None:
    """The first alias (``*name``) of ``text``, with its position, or None (also for text YAML
    cannot read: the other checks report that)."""
    if "&" not in text:
        return None  # no anchor, no alias: the common case costs one substring search
    try:
        for event in yaml.parse(text, Loader=SpecLoader):
            if isinstance(event, yaml.AliasEvent):
                return event
    except yaml.YAMLError:
        return None
    return None


def parse_spec_text(text: str, file: str = "<string>") -> PipelineSpec:
    """Parse and validate YAML text. Raises :class:`SpecError` listing every problem.

    A valid file takes the fast path (plain data, one validation); anything wrong is re-read
    keeping every node's position, so that each problem is reported at its line and column.
    Aliases (``*name``) are refused before anything is built: nine lines of nested aliases
    expand to hundreds of millions of values (the "billion laughs" pattern), and specs are read
    by Airflow's DAG processor.
    """
    try:
        return _parse(text, file)
    except UnicodeEncodeError:  # a lone surrogate: text decoded with errors="surrogateescape"
        found = re.search("[\ud800-\udfff]", text)
        if found is None:
            raise
        at = found.start()
        line = text.count("\n", 0, at) + 1
        column = at - (text.rfind("\n", 0, at) + 1) + 1
        raise SpecError([SpecIssue(file, line, column, path_at(text[:at]),
                                   f"not UTF-8 text (got {text[at]!r}, which no UTF-8 file "
                                   f"holds; expected UTF-8): save the file as UTF-8")]) from None


def _parse(text: str, file: str) -> PipelineSpec:
    alias = _first_alias(text)
    if alias is not None:
        mark = alias.start_mark
        raise SpecError([SpecIssue(
            file, mark.line + 1, mark.column + 1, path_at(text[:mark.index]),
            f"YAML aliases are not supported in a pipeline spec (got the alias *{alias.anchor}; "
            f"expected the value written out): an alias can make a small file expand without "
            f"bound")])
    try:
        data = yaml.load(text, Loader=_FastLoader)  # noqa: S506 - a SafeLoader subclass
        if isinstance(data, dict):
            return PipelineSpec.model_validate(data, context={SPEC_FILE: True})
    except Exception:  # noqa: BLE001 - whatever it is, the careful path reports it in place
        # (PyYAML's constructors raise AttributeError or TypeError on some tagged values, e.g.
        # `!!timestamp hello`; a real bug in the model is raised again by the careful path)
        pass
    return parse_with_positions(text, file)


_cache_dir: Path | None = None


def enable_cache(folder: str | Path | None) -> None:
    """Keep each valid spec, as validated JSON, in ``folder`` (None: no cache, the default).

    The DAG files parse every spec again each time Airflow re-parses them, in a fresh process;
    reading the YAML (with positions) is most of the cost. A cache entry is used only when its
    key matches: the SHA-256 of the file's bytes and :func:`code_version` (the spec model's
    source files), so an edited spec or an upgraded model is always read again. Only valid
    specs are cached: errors are always found by the careful path, with their positions. A
    cached spec is validated again by the same model (cheap: JSON in, no YAML).
    """
    global _cache_dir
    _cache_dir = Path(folder) if folder is not None else None


_code_version: str | None = None


def code_version() -> str:
    """A digest of the spec model's source files (name, size, mtime) and pydantic's version."""
    global _code_version
    if _code_version is None:
        import hashlib

        import pydantic

        digest = hashlib.sha256(pydantic.VERSION.encode())
        for source in sorted(Path(__file__).parent.glob("*.py")):
            stat = source.stat()
            digest.update(f"{source.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
        _code_version = digest.hexdigest()[:16]
    return _code_version


def _cache_entry(path: Path) -> Path | None:
    if _cache_dir is None:
        return None
    import hashlib

    return _cache_dir / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")


def _from_cache(entry: Path | None, key: str) -> PipelineSpec | None:
    if entry is None:
        return None
    import json

    try:
        cached = json.loads(entry.read_bytes())
        if cached.get("key") == key:
            return PipelineSpec.model_validate(cached["spec"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError):
        pass  # missing, unreadable or outdated: the careful path decides
    return None


def _to_cache(entry: Path | None, key: str, spec: PipelineSpec) -> None:
    if entry is None:
        return
    import json
    import os

    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "spec": spec.model_dump(mode="json")}))
        os.replace(tmp, entry)  # atomic: readers see the old entry or the new one
    except OSError:  # a read-only or full disk only costs speed
        tmp.unlink(missing_ok=True)


def load_spec(path: str | Path) -> PipelineSpec:
    """Read and validate one pipeline file (see :func:`enable_cache` for the optional cache).

    Raises:
        SpecError: the file is not valid; every problem is listed with file, line and column.
        OSError: the file cannot be read.
    """
    path = Path(path)
    raw = path.read_bytes()
    entry = _cache_entry(path)
    if entry is not None:
        import hashlib

        key = f"{hashlib.sha256(raw).hexdigest()}:{code_version()}"
        cached = _from_cache(entry, key)
        if cached is not None:
            return cached
        spec = _load_bytes(raw, path)
        _to_cache(entry, key, spec)
        return spec
    return _load_bytes(raw, path)


def _load_bytes(raw: bytes, path: Path) -> PipelineSpec:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = raw.rfind(b"\n", 0, err.start) + 1
        line = raw[: err.start].count(b"\n") + 1
        # the column counts characters, like YAML's own marks: decode the valid part of the line
        column = len(raw[line_start: err.start].decode("utf-8", errors="replace")) + 1
        field = path_at(raw[: err.start].decode("utf-8", errors="replace"))
        raise SpecError([SpecIssue(str(path), line, column, field,
                                   f"not UTF-8 text (got byte {raw[err.start]:#04x} at offset "
                                   f"{err.start}; expected UTF-8): save the file as UTF-8")]) from None
    return parse_spec_text(text, file=str(path))


def validate_overrides(spec: PipelineSpec, overrides: dict[str, Any]) -> PipelineSpec:
    """Apply dotted-path overrides (e.g. from DAG params) and validate them with the same model.

    Raises:
        SpecError: an override names an unknown field or gives a value the model rejects.
    """
    data = spec.model_dump(mode="json")
    for key_path, value in overrides.items():
        node = data
        parts = key_path.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise SpecError([SpecIssue("<params>", 1, 1, key_path, "unknown field")])
            node = node[part]
        if parts[-1] not in node:
            raise SpecError([SpecIssue("<params>", 1, 1, key_path, "unknown field")])
        node[parts[-1]] = value
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(
            [
                SpecIssue("<params>", 1, 1, dotted(e["loc"]), _describe(e))
                for e in err.errors()
            ]
        ) from err


def name_position(file: Path) -> tuple[int, int]:
    """``(line, column)``, 1-based, of the value of ``pipeline.name`` in the YAML ``file``.

    ``(1, 1)`` when it cannot be located (the file was read and validated just before).
    """
    return value_position(file, ("pipeline", "name"))


def value_position(file: Path, keys: tuple[str | int, ...]) -> tuple[int, int]:
    """``(line, column)``, 1-based, of the value at ``keys`` in the YAML ``file`` (a string
    keys a mapping, an int a list): of the deepest of them that is there, ``(1, 1)`` when not
    even the first is."""
    try:
        root = yaml.compose(file.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return 1, 1
    node, found = root, None
    for key in keys:
        if isinstance(key, int) and isinstance(node, yaml.SequenceNode):
            node = node.value[key] if 0 <= key < len(node.value) else None
        elif isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if getattr(k, "value", None) == key), None)
        else:
            break
        if node is None:
            break
        found = node
    if found is None:
        return 1, 1
    return found.start_mark.line + 1, found.start_mark.column + 1
