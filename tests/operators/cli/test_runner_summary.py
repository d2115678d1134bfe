"""The summary `trainforge run` prints: the eval-gate row, the teardown apart from the stages."""

from pathlib import Path

import pytest

from trainforge.cli.runner_summary import gate_line, print_summary, split_teardown
from trainforge.graph import task_graph
from trainforge.pipeline import load_spec

DEMO = Path(__file__).resolve().parents[3] / "dags" / "pipelines" / "shakespeare_llm.yaml"


@pytest.mark.parametrize(("summary", "line"), [
    ({"stages": {"register_model": {"state": "upstream_failed"}}},
     "not run: register_model did not finish (state upstream_failed)"),
    ({}, "not run: register_model did not finish"),
    ({"gate_decision": "pass", "gate_reason": "first version", "champion_after": "1"},
     "pass: first version (champion is now v1)"),
    ({"gate_decision": "fail", "gate_reason": "val_loss 5.1 vs 4.9", "champion_after": "1"},
     "fail: val_loss 5.1 vs 4.9 (champion stays v1)"),
    ({"gate_decision": "fail", "gate_reason": "above max_val_loss", "champion_after": "none"},
     "fail: above max_val_loss (no champion: the alias stays unset)"),
])
def test_the_gate_row_says_whether_the_gate_ran_and_where_the_champion_is(summary, line):
    assert gate_line(summary) == line


def test_the_summary_lists_the_teardown_apart_from_the_stages():
    from rich.console import Console

    times = {"prepare_data": {"state": "success", "seconds": 3.0},
             "train": {"state": "failed", "seconds": 40.0},
             "close_run": {"state": "success", "seconds": 2.5}}
    split = split_teardown(task_graph(load_spec(DEMO)), times)
    assert list(split["stages"]) == ["prepare_data", "train"]
    assert split["teardown"] == {"close_run": {"state": "success", "seconds": 2.5}}
    console = Console(record=True, width=200)
    print_summary({"dag_id": "d", "airflow_run_id": "r", "state": "failed", **split}, console)
    text = console.export_text()
    assert "stage train" in text and "stage close_run" not in text
    assert "teardown close_run" in text and "does not decide the run's state" in text


def test_the_summary_lists_every_failed_try_not_only_the_last_state():
    from rich.console import Console

    from trainforge.cli.runner_summary import failed_tries

    tags = {"trainforge.failed_try.train.2": "job k failed after training: post-training "
                                             "collective timeout on rank 1",
            "trainforge.failed_try.train.3": "RuntimeError: [/w/gloo/tcp/pair.cc:553] Connection "
                                             "closed by peer [rank1] [bold]",
            "trainforge.failed_try.train.1": "job k failed (transient): node lost",
            "trainforge.failed_task": "x"}
    tries = failed_tries(tags)
    assert [(t["task"], t["try"]) for t in tries] == [("train", 1), ("train", 2), ("train", 3)]
    console = Console(record=True, width=200)
    print_summary({"dag_id": "d", "airflow_run_id": "r", "state": "success",
                   "stages": {"train": {"state": "success", "seconds": 9.0}},
                   "failed_tries": tries}, console)
    text = console.export_text()
    assert "failed try train #1" in text and "node lost" in text
    assert "failed try train #2" in text and "collective timeout on rank 1" in text
    # a reason is text, never rich markup (a closing-tag look-alike used to crash the summary)
    assert "[/w/gloo/tcp/pair.cc:553] Connection closed by peer [rank1] [bold]" in text


def test_the_summary_shows_each_ledger_in_one_row():
    from rich.console import Console

    from trainforge.ledger.read import ledger_figures

    metrics = {"goodput/percent": 62.5, "goodput/wall_s": 80.0, "gpu_hours/allocated": 0.0,
               "energy/kwh": 0.0004, "cost/allocated": 0.0, "disruptions/count": 1.0,
               "recovery/mean_s": 9.0, "recovery/max_s": 9.0, "badput/recovery_s": 6.0,
               "badput/program_startup_s": 12.0, "badput/other_s": 1.0}
    tags = {"energy/source/cpu": "estimated", "cost/currency": "USD", "unrelated": "x"}
    ledger = ledger_figures(metrics, tags)
    assert ledger["tags"] == {"energy/source/cpu": "estimated", "cost/currency": "USD"}
    console = Console(record=True, width=400)
    print_summary({"dag_id": "d", "airflow_run_id": "r", "state": "success", "ledger": {"": ledger}},
                  console)
    text = console.export_text()
    assert "goodput 62.5% of 80.0 s" in text and "cpu estimated" in text
    assert "top badput: program_startup 12.0 s, recovery 6.0 s, other 1.0 s" in text
    assert "1 disruption(s), recovery mean 9.0 s max 9.0 s" in text
