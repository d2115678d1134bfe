"""bench/goodput.py's arithmetic on a hand-made log: every term of the bound, and goodput."""

from __future__ import annotations

import datetime as dt

import pytest

from bench.goodput import measure, parse_log

T0 = dt.datetime(2026, 1, 1, 12, 0, 0)


def _line(t: float, text: str) -> str:
    stamp = (T0 + dt.timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"[default0]:{stamp} rank0 INFO trainforge.trainer.train: {text}"


def test_measure_a_run_with_one_kill():
    # Attempt 1: steps 1..25, 1 s each, checkpoint after step 10 and 20 costs 0.5 s extra.
    lines, t = [_line(0, "model: 100 parameters; ...")], 0.0
    for step in range(1, 26):
        t += 1.0 + (0.5 if step - 1 in (10, 20) else 0.0)
        lines.append(_line(t, f"step {step}/40 | loss 1.0"))
    kill = t + 0.25
    # Attempt 2 resumes from step 20: its first step (21) ends 5 s + one step after the kill.
    t = kill + 5.0
    lines.append(_line(t, "model: 100 parameters; ..."))
    for step in range(21, 41):
        t += 1.0 + (0.5 if step - 1 in (30,) else 0.0)
        lines.append(_line(t, f"step {step}/40 | loss 1.0"))
    events = parse_log("\n".join(lines))
    assert [e.attempt for e in events][:1] == [1] and events[-1].attempt == 2
    kill_epoch = (T0 + dt.timedelta(seconds=kill)).timestamp()
    out = measure(events, [kill_epoch], checkpoint_every=10)
    assert out["step_s"] == pytest.approx(1.0)
    assert out["checkpoint_stall_delta_s"] == pytest.approx(0.5)
    assert out["checkpoint_interval_T_s"] == pytest.approx(10.0)
    assert out["restart_R_s"] == pytest.approx(5.0, abs=0.01)
    # first step beyond 25 is step 26: 5 s restart + 6 steps (21..26)
    assert out["recovery_mean_s"] == pytest.approx(11.0, abs=0.01)
    assert out["kills"] == 1 and out["final_step"] == 40 and out["steps"] == 40
    assert out["productive_s"] == pytest.approx(40.0, abs=0.01)
    assert out["goodput"] == pytest.approx(40.0 / out["wall_s"])
    wall = out["wall_s"]
    assert out["goodput_bound"] == pytest.approx(1 - 0.5 / 10 - (5.0 + 5.0) / wall, abs=1e-3)
