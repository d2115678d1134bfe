"""What `trainforge run` shows on the console from Airflow's output."""

import pytest

from trainforge.runner import ConsoleFilter, console_line, gate_line


def test_task_boundaries_trainer_lines_and_failures_are_shown_and_chatter_is_not():
    lines = {
        "2026-11-29T20:06:29.291153Z [info     ] [DAG TEST] starting task_id=train map_index=-1 "
        "[airflow.sdk.definitions.dag] loc=dag.py:1501": "==> task train",
        "2026-11-29T20:07:43.673937Z [info     ] [shakespeare-llm-train-t1-dc7ff02cca] "
        "[default0]:2026-11-29 20:07:43,513 rank0 INFO trainforge.trainer.train: step 100/300 | loss 5.2 "
        "[trainforge.triggers.TrainingJobTrigger] loc=triggers.py:98":
            "    rank0 INFO trainforge.trainer.train: step 100/300 | loss 5.2",
        "trainforge.data.errors.SourceNotFoundError: no files match source pattern 'x'":
            "    !! trainforge.data.errors.SourceNotFoundError: no files match source pattern 'x'",
        "  - eval: val_perplexity 900 does not beat the unigram baseline 560":
            "    !! - eval: val_perplexity 900 does not beat the unigram baseline 560",
        "2026-11-29T20:06:29.227360Z [info     ] Task instance state updated    "
        "[airflow.api_fastapi.execution_api.routes.task_instances] loc=task_instances.py:485": None,
        '  File "/x/operators/prepare.py", line 51, in execute': None,
    }
    for line, shown in lines.items():
        assert console_line(line) == shown, line


_START = ("2026-11-29T23:30:14.108168Z [info     ] [DAG TEST] starting task_id=prepare_data "
          "map_index=-1 [airflow.sdk.definitions.dag] loc=dag.py:1501")
_RUNNING = ("2026-11-29T23:30:18.232071Z [info     ] Task instance state updated    "
            "[airflow.api_fastapi.execution_api.routes.task_instances] correlation_id=01a229a5 "
            "loc=task_instances.py:254 rows_affected=1 ti_id=01a229a5")
_END = ("2026-11-29T23:30:19.775095Z [info     ] [DAG TEST] end task task_id=prepare_data "
        "map_index=-1 [airflow.sdk.definitions.dag] loc=dag.py:1563")


def _updated(state: str) -> str:
    """The execution API's line when a task reports its state (Airflow 3.3, as logged)."""
    return ("2026-11-29T23:30:19.759573Z [info     ] Task instance state updated    "
            "[airflow.api_fastapi.execution_api.routes.task_instances] correlation_id=01a229a5 "
            f"loc=task_instances.py:485 new_state={state} rows_affected=1 ti_id=01a229a5")


@pytest.mark.parametrize(("state", "shown"), [
    ("failed", "<== task prepare_data: failed"),
    ("up_for_retry", "<== task prepare_data: up for retry"),
    ("success", "<== task prepare_data: success"),
])
def test_a_task_end_shows_the_state_airflow_recorded(state, shown):
    console = ConsoleFilter()
    assert console(_START) == "==> task prepare_data"
    assert console(_RUNNING) is None
    assert console(_updated(state)) is None
    assert console(_END) == shown


def test_a_deferred_task_ends_with_the_state_after_its_trigger():
    console = ConsoleFilter()
    console(_START)
    console(_updated("deferred"))
    console(_updated("success"))
    assert console(_END) == "<== task prepare_data: success"


def test_a_task_end_without_a_recorded_state_never_claims_done():
    assert console_line(_END) == "<== task prepare_data: ended, state unknown"
    console = ConsoleFilter()
    console(_START)
    console("2026-11-29T23:30:19.7Z [error    ] [DAG TEST] Error running task <TaskInstance: x> "
            "[airflow.sdk.definitions.dag] loc=dag.py:1556")
    assert console(_END) == "<== task prepare_data: failed"


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

    from trainforge.runner import TEARDOWN_TASK_IDS, print_summary, split_teardown
    from trainforge.teardown import CLOSE_RUN_TASK_ID

    assert TEARDOWN_TASK_IDS == (CLOSE_RUN_TASK_ID,)
    times = {"prepare_data": {"state": "success", "seconds": 3.0},
             "train": {"state": "failed", "seconds": 40.0},
             "close_run": {"state": "success", "seconds": 2.5}}
    split = split_teardown(times)
    assert list(split["stages"]) == ["prepare_data", "train"]
    assert split["teardown"] == {"close_run": {"state": "success", "seconds": 2.5}}
    console = Console(record=True, width=200)
    print_summary({"dag_id": "d", "airflow_run_id": "r", "state": "failed", **split}, console)
    text = console.export_text()
    assert "stage train" in text and "stage close_run" not in text
    assert "teardown close_run" in text and "does not decide the run's state" in text
