"""`make test` on a machine without Slurm, PostgreSQL or root: every skipped test says what to
install, in pytest's `-ra` summary and in one line per missing prerequisite below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import PREREQUISITES, prerequisite_summary, pytest_terminal_summary, skip_without

TESTS = Path(__file__).resolve().parent

#: Skips whose reason is not a missing package: no network for a test that downloads, a fixed
#: port that something else on the machine holds.
NOT_A_PACKAGE = ("cannot reach", "already taken on this machine")


def _skip_reason(call: ast.Call) -> str | None:
    """The reason text of a ``pytest.skip(...)`` or ``skipif(..., reason=...)`` call, else None."""
    name = ast.unparse(call.func)
    if name in ("pytest.skip", "skip") and call.args:
        return ast.unparse(call.args[0])
    if name.endswith("skipif"):
        return next((ast.unparse(k.value) for k in call.keywords if k.arg == "reason"), None)
    return None


def test_every_skip_reason_says_what_to_install():
    vague = []
    for path in sorted(TESTS.rglob("*.py")):
        relative = path.relative_to(TESTS).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        helpers = {n for n in ast.walk(tree)
                   if isinstance(n, ast.FunctionDef) and n.name == "skip_without"}
        inside = {id(c) for h in helpers for c in ast.walk(h)}
        for node in ast.walk(tree):
            if id(node) in inside or not isinstance(node, ast.Call):
                continue
            reason = _skip_reason(node)
            if reason is not None and "install" not in reason and not any(
                    w in reason for w in NOT_A_PACKAGE):
                vague.append(f"tests/{relative}:{node.lineno}: {reason}")
    assert not vague, "skip reasons that do not say what to install:\n" + "\n".join(vague)


@pytest.mark.parametrize("key", PREREQUISITES)
def test_a_skip_names_the_prerequisite_and_its_install_command(key):
    what, install = PREREQUISITES[key]
    with pytest.raises(pytest.skip.Exception) as info:
        skip_without(key, "detail")
    reason = str(info.value)
    assert what in reason and "(detail)" in reason and install in reason
    assert prerequisite_summary([reason, reason]) == [f"2 skipped: {what}: {install}"]


def test_the_session_summary_lists_each_missing_prerequisite_once():
    reasons = []
    for key in ("slurm", "slurm", "postgres"):
        with pytest.raises(pytest.skip.Exception) as info:
            skip_without(key)
        reasons.append(str(info.value))

    class Report:
        def __init__(self, reason: str):
            self.longrepr = ("tests/x.py", 1, f"Skipped: {reason}")

    class Reporter:
        stats = {"skipped": [Report(r) for r in reasons] + [Report("needs bash")]}
        lines: list[str] = []

        def section(self, title, sep="="):
            self.lines.append(f"--- {title}")

        def write_line(self, line):
            self.lines.append(line)

    reporter = Reporter()
    pytest_terminal_summary(reporter, 0, None)
    slurm, postgres = PREREQUISITES["slurm"], PREREQUISITES["postgres"]
    assert reporter.lines == ["--- tests skipped for missing prerequisites",
                              f"2 skipped: {slurm[0]}: {slurm[1]}",
                              f"1 skipped: {postgres[0]}: {postgres[1]}"]
