"""bench/grad_compression.py refuses bad arguments before it builds hosts or data: exit 2, the
option, the value given and what was expected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("args", "says"), [
    (["--compressions", "zip"], "--compressions 'zip': unknown zip; expected"),
    (["--compressions", ""], "--compressions '': empty; expected"),
    (["--compressions", "none,none"], "--compressions 'none,none': a name repeats"),
    (["--rates", "0mbit"], "--rates '0mbit': not a positive tc rate: 0mbit; expected"),
    (["--rates", "fast"], "--rates 'fast': not a positive tc rate: fast"),
    (["--rates", "1gbit,1gbit"], "a rate repeats"),
    (["--steps", "2"], "--steps 2: expected more than"),
    (["--eval-tokens", "-5"], "--eval-tokens -5: expected a positive number"),
    (["--corpus", "/nonexistent/corpus"], "--corpus /nonexistent/corpus: not a fetched Shakespeare corpus"),
])
def test_bad_arguments_exit_2_naming_the_value_and_what_was_expected(args, says):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grad_compression.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr
