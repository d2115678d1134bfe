"""Read a pipeline YAML file into a :class:`~trainforge.pipeline.model.PipelineSpec`.

Every problem is reported at once, one line each, in the form
``file:line:col: field.path: what is wrong (got X; expected Y)``.

YAML pitfalls handled here:

* ``1e-4`` (scientific notation without a dot) is a float, not the string YAML 1.1 makes of it;
* duplicate keys are an error, not last-one-wins;
* a tab in the indentation is named as such, at the tab; other syntax errors are reported with
  YAML's own position;
* an unquoted key YAML reads as a boolean or number (``on:``, ``1:``) is an error naming the
  key as written, with the quoted form to use;
* a quoted number given for a number field is an error (the published JSON Schema says
  ``integer`` or ``number``), see :class:`trainforge.sections.SpecModel`.

pydantic's own wording is turned into the one-line form: a union reports only the member that
fits the value's shape (or one "got a mapping; expected a number, string or boolean"), and an
empty or non-mapping section says so instead of naming a class.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainforge.pipeline.messages import _data_loc, _describe, _one_error_per_union, _position
from trainforge.pipeline.model import PipelineSpec

_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


@dataclass(frozen=True)
class SpecIssue:
    """One problem in one spec file."""

    file: str
    line: int
    column: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class SpecError(ValueError):
    """A pipeline spec is invalid. ``issues`` holds every problem found; ``str()`` lists them."""

    def __init__(self, issues: Iterable[SpecIssue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when available: ~5x faster


class _Loader(_Base):  # type: ignore[misc, valid-type]
    """SafeLoader that reads ``1e-4`` as a float."""


_Loader.yaml_implicit_resolvers = {
    key: [r for r in resolvers if r[0] != "tag:yaml.org,2002:float"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


class _NodeError(Exception):
    """A node YAML can parse but not turn into plain data (a bad date, a list as a key)."""

    def __init__(self, mark: yaml.Mark, path: tuple, message: str):
        super().__init__(message)
        self.line, self.column = mark.line + 1, mark.column + 1
        self.path = ".".join(str(p) for p in path)
        self.message = message


def _construct(loader: _Loader, node: yaml.Node, path: tuple):
    try:
        value = loader.construct_object(node, deep=True)
    except ValueError as err:  # e.g. 2026-13-45 read as a date
        if node.tag == "tag:yaml.org,2002:timestamp":
            raise _NodeError(node.start_mark, path,
                             f"not a valid date (got {node.value!r}: {err}; expected YYYY-MM-DD)")
        raise _NodeError(node.start_mark, path,
                         f"YAML could not read {node.value!r}: {err} (quote it if it is text)")
    return value


def _walk(node: yaml.Node, loader: _Loader, path: tuple, marks: dict, issues: list, file: str):
    """Turn a composed YAML node into plain data, recording the position of every path.

    The raw text of each plain (unquoted) scalar is kept in ``marks[("raw",) + path]`` so that
    errors can explain what YAML made of it.
    """
    marks[path] = node.start_mark
    if isinstance(node, yaml.ScalarNode) and not node.style:  # plain: None (Python) or "" (libyaml)
        marks[("raw",) + path] = node.value
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _construct(loader, key_node, path)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise _NodeError(key_node.start_mark, path,
                                 f"a key must be a plain name (got a {type(key).__name__})")
            if (not isinstance(key, str) and key is not None and isinstance(key_node, yaml.ScalarNode)
                    and not key_node.style):
                # `on:` is the boolean True to YAML 1.1, `1:` the integer 1; every key of a spec
                # is text. Report it, and read on with the key as written.
                what = "boolean" if isinstance(key, bool) else type(key).__name__
                issues.append(SpecIssue(
                    file, key_node.start_mark.line + 1, key_node.start_mark.column + 1,
                    ".".join(str(p) for p in path + (key_node.value,)),
                    f"key {key_node.value!r} is read by YAML as the {what} {key!r} (got {key!r}; "
                    f"expected a text key: quote it, \"{key_node.value}\")"))
                key = key_node.value
            if key in out:
                first = marks[path + (key,)]
                issues.append(
                    SpecIssue(
                        file,
                        key_node.start_mark.line + 1,
                        key_node.start_mark.column + 1,
                        ".".join(str(p) for p in path + (key,)),
                        f"duplicate key (first given on line {first.line + 1}; each key may "
                        f"appear once)",
                    )
                )
                continue
            out[key] = _walk(value_node, loader, path + (key,), marks, issues, file)
            if isinstance(value_node, (yaml.MappingNode, yaml.SequenceNode)):
                # Errors about a whole section point at its key, not its first child.
                marks[path + (key,)] = key_node.start_mark
        return out
    if isinstance(node, yaml.SequenceNode):
        return [
            _walk(item, loader, path + (i,), marks, issues, file) for i, item in enumerate(node.value)
        ]
    try:
        return _construct(loader, node, path)
    except _NodeError as err:  # e.g. a bad date: report it, keep reading the rest of the file
        issues.append(SpecIssue(file, err.line, err.column, err.path, err.message))
        marks[("node_error",) + path] = True
        return None




class _DuplicateKey(Exception):
    """Raised by the fast path; the careful path reports it with positions."""


class _FastLoader(_Loader):
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
        for event in yaml.parse(text, Loader=_Loader):
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
    alias = _first_alias(text)
    if alias is not None:
        mark = alias.start_mark
        raise SpecError([SpecIssue(
            file, mark.line + 1, mark.column + 1, "",
            f"YAML aliases are not supported in a pipeline spec (got the alias *{alias.anchor}; "
            f"expected the value written out): an alias can make a small file expand without "
            f"bound")])
    try:
        data = yaml.load(text, Loader=_FastLoader)  # noqa: S506 - a SafeLoader subclass
        if isinstance(data, dict):
            return PipelineSpec.model_validate(data)
    except (yaml.YAMLError, ValidationError, _DuplicateKey, TypeError, ValueError):
        pass
    return _parse_with_positions(text, file)


def _indenting_tab(text: str, line: int) -> tuple[int, int] | None:
    """Line and column (1-based) of a tab in the indentation of line ``line``, where YAML
    reported a syntax error (YAML forbids tabs there; libyaml calls one "a character that
    cannot start any token"), or None when the line has none."""
    lines = text.splitlines()
    if 1 <= line <= len(lines):
        current = lines[line - 1]
        indent = current[: len(current) - len(current.lstrip(" \t"))]
        if "\t" in indent:
            return line, indent.index("\t") + 1
    return None


def _unreadable_character(text: str, file: str, err: yaml.reader.ReaderError) -> SpecIssue:
    """The issue of a character YAML refuses (NUL, ESC, other control characters): at its line
    and column, computed from the offset the reader reports."""
    position = max(0, min(int(err.position), len(text)))
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    char = err.character if isinstance(err.character, str) else chr(err.character)
    return SpecIssue(file, line, column, "",
                     f"YAML does not allow the control character {char!r} (got it at offset "
                     f"{position}; expected printable text): remove it, or save the file as "
                     f"UTF-8 if it is UTF-16")


def _parse_with_positions(text: str, file: str) -> PipelineSpec:
    loader = _Loader(text)
    try:
        try:
            root = loader.get_single_node()
        except yaml.reader.ReaderError as err:  # a control character: it carries an offset only
            raise SpecError([_unreadable_character(text, file, err)]) from None
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
            tab = _indenting_tab(text, line)
            if tab is not None:
                line, col = tab
                message = (f"a tab is used for indentation; YAML indents with spaces, not tabs "
                           f"(got a tab at column {col}; expected spaces)")
            else:
                message = f"YAML syntax error: {err.problem}"
            raise SpecError([SpecIssue(file, line, col, "", message)]) from None
        if root is None:
            raise SpecError([SpecIssue(file, 1, 1, "", "the file is empty (expected a mapping)")])
        marks: dict[tuple, yaml.Mark] = {}
        issues: list[SpecIssue] = []
        try:
            data = _walk(root, loader, (), marks, issues, file)
        except yaml.MarkedYAMLError as err:  # e.g. merge keys (<<) and unknown tags
            mark = err.problem_mark or err.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
            problem = err.problem or str(err)
            if "merge" in problem:
                problem += " (merge keys '<<' and anchors are not supported: write the values out)"
            raise SpecError([SpecIssue(file, line, col, "", f"YAML error: {problem}")]) from None
        except _NodeError as err:
            raise SpecError([SpecIssue(file, err.line, err.column, err.path, err.message)]) from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise SpecError(
            [SpecIssue(file, 1, 1, "", f"top level must be a mapping (got {type(data).__name__})")]
        )
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as err:
        seen = set(issues)  # a set: a file with thousands of mistakes stays linear
        for e in _one_error_per_union(err.errors(), data, marks):
            e["loc"] = _data_loc(tuple(e["loc"]), marks)
            if any(("node_error",) + tuple(e["loc"][:cut]) in marks
                   for cut in range(len(e["loc"]) + 1)):
                continue  # already reported: YAML could not read the value
            line, col = _position(marks, e["loc"], e)
            path = ".".join(str(p) for p in e["loc"])
            issue = SpecIssue(file, line, col, path, _describe(e, marks))
            if issue not in seen:
                seen.add(issue)
                issues.append(issue)
        spec = None
    if issues:
        issues.sort(key=lambda i: (i.line, i.column))
        raise SpecError(issues)
    return spec


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
        raise SpecError([SpecIssue(str(path), line, column, "",
                                   f"not UTF-8 text (got byte {raw[err.start]:#04x} at offset "
                                   f"{err.start}; expected UTF-8): save the file as UTF-8")]) from None
    return parse_spec_text(text, file=str(path))


def validate_overrides(spec: PipelineSpec, overrides: dict[str, Any]) -> PipelineSpec:
    """Apply dotted-path overrides (e.g. from DAG params) and validate them with the same model.

    Raises:
        SpecError: an override names an unknown field or gives a value the model rejects.
    """
    data = spec.model_dump(mode="json")
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise SpecError([SpecIssue("<params>", 1, 1, dotted, "unknown field")])
            node = node[part]
        if parts[-1] not in node:
            raise SpecError([SpecIssue("<params>", 1, 1, dotted, "unknown field")])
        node[parts[-1]] = value
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(
            [
                SpecIssue("<params>", 1, 1, ".".join(str(p) for p in e["loc"]), _describe(e))
                for e in err.errors()
            ]
        ) from err


def name_position(file: Path) -> tuple[int, int]:
    """``(line, column)``, 1-based, of the value of ``pipeline.name`` in the YAML ``file``.

    ``(1, 1)`` when it cannot be located (the file was read and validated just before).
    """
    import yaml

    try:
        root = yaml.compose(file.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return 1, 1
    node = root
    for key in ("pipeline", "name"):
        if not isinstance(node, yaml.MappingNode):
            return 1, 1
        node = next((v for k, v in node.value if getattr(k, "value", None) == key), None)
        if node is None:
            return 1, 1
    return node.start_mark.line + 1, node.start_mark.column + 1
