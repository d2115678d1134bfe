"""Fuzzing the spec loader: valid specs, mutated the way people and editors break them.

Mutations of the data (delete, retype, move and misspell keys) and of the text (duplicated
lines, anchors and aliases, tabs, control characters, huge numbers, YAML booleans and nulls,
nested garbage, a cut-off file). Whatever the mutation, ``trainforge validate`` never shows a
traceback: it exits 0 for a spec that is still valid, else 1 with one line per problem, each of
the form ``file:line:col: field.path: message``.

Bounded: the ``spec-fuzz`` settings profile fixes the number of examples, a per-example deadline
(a slow parse is a defect too: specs are read by Airflow's DAG processor), derandomizes the
examples and keeps no example database, so a run is the same on every machine.
TRAINFORGE_FUZZ_EXAMPLES raises the count for a longer local run.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from trainforge.cli.main import app
from trainforge.pipeline import PipelineSpec, SpecError, parse_spec_text

ROOT = Path(__file__).resolve().parents[3]

settings.register_profile(
    "spec-fuzz",
    max_examples=int(os.environ.get("TRAINFORGE_FUZZ_EXAMPLES", "120")),
    deadline=dt.timedelta(seconds=5),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ = settings.get_profile("spec-fuzz")

MINIMAL = """\
pipeline:
  name: tiny
  schedule: '0 3 * * 1'
  defaults:
    retries: 1
    retry_delay: 30s
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
  fault:
    run_timeout: 1h
registry:
  model_name: tiny-llm
  aliases: [challenger]
stages:
  - name: pretrain
  - name: finetune
    depends_on: [pretrain]
    training:
      optimization:
        max_steps: 5
"""
BASES = [MINIMAL, (ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml").read_text()]

#: One problem as the CLI prints it: the file, line and column, the field path, the message.
#: A path is dotted keys and indexes, a key that is not a plain name in double quotes, or
#: "(top level)" for a problem outside any field.
_PART = r'(?:"(?:[^"\\]|\\.)*"|[^\s:".]+)'
ISSUE_LINE = re.compile(rf"^(?P<file>[^:]+):(?P<line>\d+):(?P<col>\d+): "
                        rf"(?P<path>\(top level\)|{_PART}(?:\.{_PART})*): \S")

# -- values -----------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 10), st.integers(min_value=10**18),
    st.integers(max_value=-(10**18)), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "yes", "no", "on", "off", "~", "null", "1e-4", "0s", "5 minutes", "@weekly",
                     "*/5 * * * *", "s3://", "models:/x@champion", "2026-02-30", "1e999",
                     "ÿ" * 3, "a" * 300]),
)
GARBAGE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.one_of(st.text(max_size=8), st.integers(0, 3)), inner, max_size=3),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into ``node`` (mapping keys and list indexes), the root excluded."""
    out = []
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return out
    for key, value in items:
        out.append(prefix + (key,))
        out += _paths(value, prefix + (key,))
    return out


def _parent(data: Any, path: tuple) -> Any:
    for part in path[:-1]:
        data = data[part]
    return data


def _mappings(data: Any) -> list[tuple]:
    """Paths of every mapping in ``data``, the top level (``()``) included."""
    return [()] + [p for p in _paths(data) if isinstance(_parent(data, p + ("x",)), dict)]


def _misspell(key: str, draw) -> str:
    if not key:
        return "x"
    i = draw(st.integers(0, len(key) - 1))
    how = draw(st.sampled_from(["drop", "double", "swap", "case", "space"]))
    if how == "drop":
        return key[:i] + key[i + 1:] or "x"
    if how == "double":
        return key[:i] + key[i] + key[i:]
    if how == "swap" and i + 1 < len(key):
        return key[:i] + key[i + 1] + key[i] + key[i + 2:]
    if how == "case":
        return key.upper()
    return key + " "


@st.composite
def data_mutation(draw, text: str) -> str:
    """The spec as data, with one to three keys deleted, retyped, moved or misspelled."""
    try:
        data = yaml.safe_load(text)
    except Exception:  # noqa: BLE001 - PyYAML raises more than YAMLError on bad tagged values
        return text  # already broken by a text trick: nothing to mutate as data
    if not isinstance(data, dict):
        return text
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _parent(data, path)
        kind = draw(st.sampled_from(["delete", "retype", "move", "misspell"]))
        if kind == "retype":
            parent[path[-1]] = draw(GARBAGE)
        elif isinstance(parent, list):
            parent.pop(path[-1])
        else:
            value = parent.pop(path[-1])
            if kind == "move":
                target = _parent(data, draw(st.sampled_from(_mappings(data))) + ("x",))
                target.setdefault(path[-1], value)
            elif kind == "misspell" and isinstance(path[-1], str):
                parent[_misspell(path[-1], draw)] = value
    try:
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    except yaml.YAMLError:
        return text


FLOW_GARBAGE = ["{a: [1, {b: ", "[[[[", "{{}}", "}{", "[1,,2]", "{a: 1, a: 2}", '"unterminated',
                "|", ">-", "? a", "[*a]", "{&a x: 1}"]
TEXT_TRICKS = [
    "duplicate_line", "anchor_alias", "undefined_alias", "merge_key", "tab", "control_char",
    "huge_number", "yaml_word", "star_value", "cut", "tag", "indent", "flow_garbage", "bom",
    "invalid_utf8_as_text",
]


@st.composite
def text_mutation(draw, text: str) -> str:
    """The spec as text, with one to three YAML tricks injected at chosen lines."""
    for _ in range(draw(st.integers(1, 3))):
        lines = text.splitlines(keepends=True) or ["\n"]
        i = draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        body = line.rstrip("\n")
        indent = body[: len(body) - len(body.lstrip(" "))]
        key, sep, value = body.partition(": ")
        trick = draw(st.sampled_from(TEXT_TRICKS))
        if trick == "duplicate_line":
            lines.insert(i, line)
        elif trick == "anchor_alias" and sep:
            name = draw(st.sampled_from(["a", "x1", "long_anchor"]))
            lines[i] = f"{key}: &{name} {value}\n"
            j = draw(st.integers(0, len(lines) - 1))
            k, s, _ = lines[j].rstrip("\n").partition(": ")
            if s and j != i:
                lines[j] = f"{k}: *{name}\n"
        elif trick == "undefined_alias" and sep:
            lines[i] = f"{key}: *{draw(st.sampled_from(['nothing', 'a']))}\n"
        elif trick == "merge_key":
            lines.insert(i, f"{indent}<<: {draw(st.sampled_from(['*a', '{x: 1}', '[1]']))}\n")
        elif trick == "tab":
            lines[i] = "\t" + line.lstrip(" ") if draw(st.booleans()) else line.replace(": ", ":\t", 1)
        elif trick == "control_char":
            char = draw(st.sampled_from([chr(c) for c in [*range(0, 9), 11, 12, *range(14, 32)]]
                                        + ["\x7f", "\x85", "\ufffe", "\u2028"]))
            at = draw(st.integers(0, len(line)))
            lines[i] = line[:at] + char + line[at:]
        elif trick == "huge_number" and sep:
            number = draw(st.sampled_from(["9" * 400, "-" + "9" * 30, "1e400", "-1e400", ".inf",
                                           "-.inf", ".nan", "0x" + "f" * 40, "0o777", "1_000",
                                           "1.5e-400"]))
            lines[i] = f"{key}: {number}\n"
        elif trick == "yaml_word" and sep:
            word = draw(st.sampled_from(["yes", "No", "ON", "off", "y", "n", "~", "null", "Null",
                                         "true", "FALSE", "''", '""', "[]", "{}", "-", "?", "!!null"]))
            lines[i] = f"{key}: {word}\n"
        elif trick == "star_value" and sep:
            lines[i] = f"{key}: {draw(st.sampled_from(['* * * * *', '*/5 * * * *', '*.txt', '*']))}\n"
        elif trick == "cut":
            lines = lines[:i] + [line[: draw(st.integers(0, len(line)))]]
        elif trick == "tag" and sep:
            tag = draw(st.sampled_from(["!!python/object:os.system", "!!binary", "!!set", "!custom",
                                        "!!timestamp", "!!int", "!!str", "!!float", "!!omap"]))
            lines[i] = f"{key}: {tag} {value}\n"
        elif trick == "indent":
            lines[i] = " " * draw(st.integers(0, 7)) + line.lstrip(" ")
        elif trick == "flow_garbage" and sep:
            lines[i] = f"{key}: {draw(st.sampled_from(FLOW_GARBAGE))}\n"
        elif trick == "bom":
            lines[i] = "\ufeff" + line
        elif trick == "invalid_utf8_as_text":
            lines[i] = line.replace(" ", " \udcff", 1) if " " in line else line
        text = "".join(lines)
    return text


@st.composite
def mutated_spec(draw) -> str:
    text = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(1, 2))):
        if draw(st.booleans()):
            text = draw(data_mutation(text))
        else:
            text = draw(text_mutation(text))
    return text


# -- the properties ---------------------------------------------------------------------------

def _outcome(text: str) -> tuple[PipelineSpec | None, list]:
    """The spec, or the issues; any other exception fails the test with its traceback."""
    try:
        return parse_spec_text(text, "fuzz.yaml"), []
    except SpecError as err:
        return None, err.issues


def _check_issue_lines(lines: list[str], file: str, text: str) -> None:
    assert lines, "an invalid spec gave no error line"
    n_lines = text.count("\n") + 2
    for line in lines:
        match = ISSUE_LINE.match(line)
        assert match, f"not file:line:col: field.path: message: {line!r}"
        assert match["file"] == file, line
        assert 1 <= int(match["line"]) <= n_lines and int(match["col"]) >= 1, line
        assert "Traceback" not in line and "pydantic" not in line.lower(), line


@FUZZ
@given(mutated_spec())
def test_a_mutated_spec_is_valid_or_every_error_has_a_place_and_a_field(text):
    spec, issues = _outcome(text)
    if spec is not None:
        assert isinstance(spec, PipelineSpec)
        return
    _check_issue_lines([str(i) for i in issues], "fuzz.yaml", text)


runner = CliRunner()


@FUZZ
@given(mutated_spec())
def test_validate_never_shows_a_traceback_and_exits_1_on_any_error(text):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzz.yaml"
        # surrogates stand for bytes that are not UTF-8 (a Latin-1 file): write them as such
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        result = runner.invoke(app, ["validate", str(path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}")
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        assert "ok (dag_id" in result.stdout
        return
    assert result.exit_code == 1, result.output
    _check_issue_lines(result.stderr.splitlines(), str(path), text)


#: Fixed mutations for the real executable: one of each family the fuzzer draws from.
SUBPROCESS_CASES = {
    "moved.yaml": MINIMAL.replace("  name: tiny\n", "").replace("pipeline:\n", "name: tiny\npipeline:\n"),
    "alias.yaml": MINIMAL.replace("'0 3 * * 1'", "*/5 * * * *"),
    "control.yaml": MINIMAL.replace("tiny-llm", "tiny\x1b-llm"),
    "latin1.yaml": MINIMAL.replace("tiny-llm", "tiny\udce9"),  # the byte 0xe9 alone
    "retyped.yaml": MINIMAL.replace("max_steps: 10", "max_steps: {a: [1, {b: null}]}"),
    "huge.yaml": MINIMAL.replace("retries: 1", "retries: " + "9" * 400),
    "cut.yaml": MINIMAL[: MINIMAL.index("registry:") + 5],
}


def test_validate_through_the_real_executable(tmp_path):
    for name, text in SUBPROCESS_CASES.items():
        (tmp_path / name).write_bytes(text.encode("utf-8", errors="surrogateescape"))
    exe = Path(sys.executable).with_name("trainforge")
    result = subprocess.run([str(exe), "validate", str(tmp_path)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    for line in lines:
        assert ISSUE_LINE.match(line), line
    assert {Path(ISSUE_LINE.match(line)["file"]).name for line in lines} == set(SUBPROCESS_CASES)


@pytest.mark.parametrize("trick", TEXT_TRICKS)
def test_every_text_trick_changes_some_spec(trick):
    """The fuzzer's tricks are not silently inert (a guard on the strategies themselves)."""
    from hypothesis import find

    def applied(text: str) -> bool:
        return text != MINIMAL

    # a trick that never changes the text would make the properties above vacuous for it
    original = TEXT_TRICKS[:]
    try:
        TEXT_TRICKS[:] = [trick]
        found = find(text_mutation(MINIMAL), applied,
                     settings=settings(database=None, derandomize=True, max_examples=200))
    finally:
        TEXT_TRICKS[:] = original
    assert found != MINIMAL
