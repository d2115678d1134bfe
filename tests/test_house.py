"""The limits the source keeps (docs/layout.md): no module over 400 lines, no module docstring
over 25 lines (the story goes in docs/)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
MAX_DOCSTRING_LINES = 25
SOURCE = ("operators", "trainer", "plugins", "mlflow_setup", "bench", "dags", "docker")


def _modules() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--", *(f"{d}/*.py" for d in SOURCE)], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / name for name in listed]


def test_the_source_is_listed():
    assert len(_modules()) > 100  # git ls-files found the checkout's modules


@pytest.mark.parametrize("limit", ["lines", "docstring"])
def test_no_module_passes_the_limit(limit):
    over = []
    for path in _modules():
        text = path.read_text(encoding="utf-8")
        if limit == "lines":
            count, most = len(text.splitlines()), MAX_LINES
        else:
            doc = ast.get_docstring(ast.parse(text), clean=False) or ""
            count, most = len(doc.splitlines()), MAX_DOCSTRING_LINES
        if count > most:
            over.append(f"{path.relative_to(ROOT)}: {count} {limit} (at most {most})")
    assert not over, "\n".join(over)
