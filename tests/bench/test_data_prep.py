"""The data-prep benchmark runs end to end on a small corpus and prints its ratio lines."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import data_prep  # noqa: E402


def test_one_round_prints_both_ratios_and_the_scaling_goal(tmp_path, capsys):
    args = argparse.Namespace(mib=0.25, rounds=1, memory_mib=0, budget_mib=16, keep=False)
    data_prep.run(args, tmp_path)
    out = capsys.readouterr().out
    for workers in (1, 2):
        assert re.search(rf"step/bare, {workers} worker\(s\) = \d+\.\d\d \(goal >= 0\.80\)", out)
    assert re.search(r"step scaling / bare scaling = \d+\.\d\d \(goal >= 0\.80\)", out)
    assert "memory, corpus" not in out  # --memory-mib 0 skips the memory part
