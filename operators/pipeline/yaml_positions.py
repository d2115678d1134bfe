"""Read YAML text keeping every node's position, so that each problem in a spec is reported at its
line and column (the careful path of :func:`trainforge.pipeline.loader.parse_spec_text`).

YAML pitfalls handled here:

* ``1e-4`` (scientific notation without a dot) is a float, not the string YAML 1.1 makes of it;
* duplicate keys are an error, not last-one-wins;
* a syntax error is reported at YAML's own position with the field it is in, a tab in the
  indentation as such, an unquoted value that starts with ``*`` as an alias to quote (see
  :mod:`trainforge.pipeline.yaml_syntax`);
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
from typing import Any

import yaml
from pydantic import ValidationError

from trainforge.pipeline.errors import SpecError, SpecIssue, dotted
from trainforge.pipeline.messages import (
    KEY_MARK,
    _data_loc,
    _describe,
    _one_error_per_union,
    _position,
)
from trainforge.pipeline.misplaced import explain as explain_misplaced
from trainforge.pipeline.yaml_syntax import syntax_issue, unreadable_character
from trainforge.pipeline.spec import PipelineSpec
from trainforge.pipeline.registry import SPEC_FILE

_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when available: ~5x faster


class SpecLoader(_Base):  # type: ignore[misc, valid-type]
    """SafeLoader that reads ``1e-4`` as a float."""


SpecLoader.yaml_implicit_resolvers = {
    key: [r for r in resolvers if r[0] != "tag:yaml.org,2002:float"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
SpecLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


class _NodeError(Exception):
    """A node YAML can parse but not turn into plain data (a bad date, a list as a key)."""

    def __init__(self, mark: yaml.Mark, path: tuple, message: str):
        super().__init__(message)
        self.line, self.column = mark.line + 1, mark.column + 1
        self.path = dotted(path)
        self.message = message


def _construct(loader: SpecLoader, node: yaml.Node, path: tuple):
    try:
        value = loader.construct_object(node, deep=True)
    except ValueError as err:  # e.g. 2026-13-45 read as a date
        if node.tag == "tag:yaml.org,2002:timestamp":
            raise _NodeError(node.start_mark, path,
                             f"not a valid date (got {node.value!r}: {err}; expected YYYY-MM-DD)")
        raise _NodeError(node.start_mark, path,
                         f"YAML could not read {node.value!r}: {err} (quote it if it is text)")
    except yaml.MarkedYAMLError as err:  # a merge key (<<) or a tag YAML cannot construct
        problem = err.problem or str(err)
        if "merge" in problem or node.tag == "tag:yaml.org,2002:merge":
            problem += " (merge keys '<<' and anchors are not supported: write the values out)"
        elif node.tag and not node.tag.startswith("tag:yaml.org,2002:"):
            problem = _tag_message(node.tag)
        raise _NodeError(node.start_mark, path, f"YAML error: {problem}") from None
    except Exception as err:  # noqa: BLE001 - PyYAML's constructors on tagged values
        # `!!bool maybe` raises KeyError, `!!timestamp hello` AttributeError: say which
        # value could not be read as which tag, never a traceback
        shown = str(node.tag).replace("tag:yaml.org,2002:", "!!")
        raise _NodeError(node.start_mark, path,
                         f"YAML could not read {node.value!r} as {shown} ({type(err).__name__}: "
                         f"{err}; expected a value without a tag)") from None
    return value


_PLAIN_TAGS = {"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"}


def _tag_message(tag: str) -> str:
    shown = tag.replace("tag:yaml.org,2002:", "!!")
    return (f"YAML tags are not supported in a pipeline spec (got {shown}; expected the value "
            f"without a tag)")


def _walk(node: yaml.Node, loader: SpecLoader, path: tuple, marks: dict, issues: list, file: str):
    """Turn a composed YAML node into plain data, recording the position of every path.

    The raw text of each plain (unquoted) scalar is kept in ``marks[("raw",) + path]`` so that
    errors can explain what YAML made of it.
    """
    marks[path] = node.start_mark
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.tag not in _PLAIN_TAGS:
        # `!!set {a: null}`, `!custom [1]`: report the tag, and read on as a plain collection
        issues.append(SpecIssue(file, node.start_mark.line + 1, node.start_mark.column + 1,
                                dotted(path), _tag_message(node.tag)))
        marks[("node_error",) + path] = True
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
                    dotted(path + (key_node.value,)),
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
                        dotted(path + (key,)),
                        f"duplicate key (first given on line {first.line + 1}; each key may "
                        f"appear once)",
                    )
                )
                continue
            marks[KEY_MARK + path + (key,)] = key_node.start_mark
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


def parse_with_positions(text: str, file: str) -> PipelineSpec:
    """Parse and validate ``text`` keeping every node's position.

    Raises:
        SpecError: every problem found, sorted by line and column.
    """
    loader = SpecLoader(text)
    try:
        try:
            root = loader.get_single_node()
        except yaml.reader.ReaderError as err:  # a control character: it carries an offset only
            raise SpecError([unreadable_character(text, file, err)]) from None
        except yaml.MarkedYAMLError as err:
            raise SpecError([syntax_issue(text, file, err)]) from None
        if root is None:
            raise SpecError([SpecIssue(file, 1, 1, "", "the file is empty (expected a mapping)")])
        marks: dict[tuple, yaml.Mark] = {}
        issues: list[SpecIssue] = []
        try:
            data = _walk(root, loader, (), marks, issues, file)
        except _NodeError as err:
            raise SpecError([SpecIssue(file, err.line, err.column, err.path, err.message)]) from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise SpecError(
            [SpecIssue(file, 1, 1, "", f"top level must be a mapping (got {type(data).__name__})")]
        )
    try:
        spec = PipelineSpec.model_validate(data, context={SPEC_FILE: True})
    except ValidationError as err:
        seen = set(issues)  # a set: a file with thousands of mistakes stays linear
        errors = _one_error_per_union(err.errors(), data, marks)
        for e in errors:
            e["loc"] = _data_loc(tuple(e["loc"]), marks)
        for e in explain_misplaced(errors, PipelineSpec, data):
            if any(("node_error",) + tuple(e["loc"][:cut]) in marks
                   for cut in range(len(e["loc"]) + 1)):
                continue  # already reported: YAML could not read the value
            line, col = _position(marks, e["loc"], e)
            path = dotted(e["loc"])
            issue = SpecIssue(file, line, col, path, _describe(e, marks))
            if issue not in seen:
                seen.add(issue)
                issues.append(issue)
        spec = None
    if issues:
        issues.sort(key=lambda i: (i.line, i.column))
        raise SpecError(issues)
    return spec
