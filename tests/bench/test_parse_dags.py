"""The parse benchmark compares like with like: its hand-written file builds the same DAGs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import parse_dags  # noqa: E402


def test_hand_written_baseline_builds_the_same_dags_as_the_yaml_specs(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_SPEC_CACHE", "off")
    specs, hand = parse_dags.write_inputs(tmp_path, 2)
    monkeypatch.setenv("TRAINFORGE_PIPELINES", str(specs))
    from_yaml = parse_dags._dags_of(
        parse_dags.parse_file(ROOT / "dags" / "trainforge_pipelines.py", "t_yaml"))
    by_hand = parse_dags._dags_of(parse_dags.parse_file(hand, "t_hand"))
    parse_dags.check_same_dags(from_yaml, by_hand)

    by_hand["bench_1"].get_task("train").retries = 5  # the check sees a difference
    with pytest.raises(AssertionError, match="bench_1: train differs"):
        parse_dags.check_same_dags(from_yaml, by_hand)
