"""bench/goodput.py's arithmetic on a hand-made log: every term of the bound, and goodput; and
the run ledger's attempt records of the same timeline against it (goodput within 2 points, one
disruption, the recovery time). tests/faults/test_exactly_once_metrics.py compares the two on a
real run with one kill."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from bench.goodput import measure, parse_log

T0 = dt.datetime(2026, 1, 1, 12, 0, 0)


def _line(t: float, text: str) -> str:
    stamp = (T0 + dt.timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"[default0]:{stamp} rank0 INFO trainforge.trainer.train: {text}"


def _timeline():
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
    return lines, kill


def test_measure_a_run_with_one_kill():
    lines, kill = _timeline()
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


def test_the_ledger_of_the_same_timeline_agrees_with_the_measurement():
    from trainforge.ledger import names as n
    from trainforge.ledger.attempts import sum_attempts
    from trainforge.ledger.build import build_ledger
    from trainforge.pipeline import load_spec

    lines, kill = _timeline()
    out = measure(parse_log("\n".join(lines)), [(T0 + dt.timedelta(seconds=kill)).timestamp()], 10)
    epoch = T0.timestamp()
    # What rank 0 recorded (log_every_steps 1): attempt 1 started 3 s before its first step,
    # last recorded at the end of step 25 (t=26); attempt 2 started 2 s after the kill, trained
    # steps 21..25 again (wasted) and 26..40, each 1 s, with one 0.5 s checkpoint stall.
    first = {"started_at": epoch - 3, "first_step_at": epoch, "recorded_at": epoch + 26.0,
             "productive_steps": 25, "tokens_per_step": 8, "world_size": 1,
             "seconds": {"startup": 3.0, "save": 1.0, "productive": 25.0}}
    second = {"started_at": epoch + kill + 2, "first_step_at": epoch + kill + 5,
              "recorded_at": epoch + kill + 5 + 20.5, "productive_steps": 15, "tokens_per_step": 8,
              "world_size": 1, "seconds": {"startup": 3.0, "save": 0.5, "wasted": 5.0,
                                           "productive": 15.0}}
    tags = {f"trainforge.ledger.attempt.{i}": json.dumps(r) for i, r in enumerate((first, second))}
    books = sum_attempts([first, second])
    assert abs(100 * books.productive_s / out["wall_s"] - 100 * out["goodput"]) <= 2.0
    spec = load_spec(Path(__file__).resolve().parents[2] / "dags" / "pipelines" / "shakespeare_llm.yaml")
    ledger = build_ledger(spec, {"handle": {}}, tags, "unknown: not priced",
                          task_started_s=epoch - 3, now_s=second["recorded_at"],
                          submitted_by_this_try=True)
    assert ledger.metrics[n.DISRUPTIONS] == out["kills"] == 1
    # failure -> restarted first step; the last record came 0.25 s before the kill
    assert ledger.metrics[n.RECOVERY_MAX_S] == pytest.approx(out["restart_R_s"] + 0.25, abs=0.01)


def test_a_step_without_a_gap_to_measure_takes_its_own_time_from_its_tok_s():
    # 2 x 4000 tokens a step; steps of 1 s (8000 tok/s), but each attempt's first step warms up
    # for 3 s (2667 tok/s): the gap to the line before it does not exist or spans the restart.
    def step(t, n, seconds):
        return _line(t, f"step {n}/20 | loss 1.0 | lr 1e-3 | grad_norm 1.0 "
                        f"| tok/s {8000 / seconds:.0f} | loss_tokens 8000")

    model = "model: 100 parameters; 20 steps of 2 sequences x 4000 tokens (micro 1 x world 2 x accum 1)"
    lines, t = [_line(0, model)], 0.0
    for n in range(1, 11):
        t += 3.0 if n == 1 else 1.0
        lines.append(step(t, n, 3.0 if n == 1 else 1.0))
    kill = t + 0.5
    t = kill + 4.0
    lines.append(_line(t, model))
    for n in range(11, 21):
        t += 3.0 if n == 11 else 1.0
        lines.append(step(t, n, 3.0 if n == 11 else 1.0))
    out = measure(parse_log("\n".join(lines)), [(T0 + dt.timedelta(seconds=kill)).timestamp()], 100)
    assert out["step_s"] == pytest.approx(1.0)
    assert out["productive_s"] == pytest.approx(24.0, abs=0.01)  # 18 x 1 s + 2 x 3 s
    assert out["wall_s"] == pytest.approx(t, abs=0.01)  # from the first step's start
    assert out["restart_R_s"] == pytest.approx(4.0, abs=0.01)  # kill to the first step's start
