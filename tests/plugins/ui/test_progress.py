"""The ETA of a live run: from the logged points' pace, else the newest attempt's ledger record,
never from the run's start (which counts data preparation and the trainer's startup)."""

from __future__ import annotations

import json

import pytest

from trainforge.contract import LEDGER_TAG_PREFIX
from trainforge.plugins.ui.training import progress


def _run(step: int, tags: dict[str, str] | None = None, start_s: float = 1_000.0) -> dict:
    return {"metrics": {"train_loss": 2.5, "tps": 900.0}, "metric_steps": {"train_loss": step},
            "metric_times": {"train_loss": int((start_s + 600) * 1000)},
            "params": {"optim.max_steps": "100"}, "info": {"start_time": int(start_s * 1000)},
            "tags": tags or {}}


def _attempt(started: float, first_step: float, recorded: float, step: int,
             resumed: int = 0) -> dict[str, str]:
    record = {"v": 1, "started_at": started, "first_step_at": first_step,
              "recorded_at": recorded, "step": step, "resumed_step": resumed, "seconds": {}}
    return {f"{LEDGER_TAG_PREFIX}{int(started * 1000)}": json.dumps(record)}


def test_the_pace_of_the_logged_points_comes_first():
    history = [{"step": 10, "timestamp": 0}, {"step": 30, "timestamp": 40_000}]
    got = progress(_run(30, _attempt(0, 1, 2, 30)), history)
    assert got["eta_s"] == pytest.approx(2.0 * 70)
    assert (got["step"], got["max_steps"], got["tokens_per_s"]) == (30, 100, 900.0)


def test_without_points_the_newest_attempt_gives_the_pace_not_the_runs_start():
    # 10 min passed since the run started (data prep, startup), but the trainer's 40 steps
    # since its resume at step 20 took 20 s: 0.5 s a step, 60 steps to go.
    tags = {**_attempt(1_000, 1_010, 1_500, 20),  # an older attempt, slower
            **_attempt(1_570, 1_580, 1_600, 60, resumed=20)}
    assert progress(_run(60, tags))["eta_s"] == pytest.approx(0.5 * 40)


@pytest.mark.parametrize("tags", [
    {},
    _attempt(1_000, 1_010, 1_010, 0),  # no step trained yet
    {f"{LEDGER_TAG_PREFIX}1000": "{not json"},
    {f"{LEDGER_TAG_PREFIX}1000": json.dumps({"v": 1, "first_step_at": None, "step": 5})},
])
def test_no_usable_record_means_no_eta_rather_than_one_counting_data_prep(tags):
    assert progress(_run(40, tags))["eta_s"] is None


def test_a_finished_run_has_no_eta():
    assert progress(_run(100, _attempt(0, 1, 50, 100)))["eta_s"] is None
