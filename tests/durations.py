"""Writes tests/durations.json, the measured seconds of each test module (setup and teardown
included), from a JUnit XML report of a whole run: ``make test PYTEST_ARGS=--junitxml=FILE``,
then ``python -m tests.durations FILE``. tests/conftest.py orders the work of the two workers
by it; refresh it with docs/testing.md's profile."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def module_seconds(junit_xml: Path) -> dict[str, float]:
    """Seconds per test module file (``tests/x/test_y.py``) in ``junit_xml``."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        seconds[module] = seconds.get(module, 0.0) + float(case.get("time") or 0.0)
    return {module: round(s, 1) for module, s in sorted(seconds.items())}


if __name__ == "__main__":
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps(module_seconds(Path(sys.argv[1])), indent=0) + "\n")
    print(f"wrote {out}")
