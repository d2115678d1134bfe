"""What `trainforge run` shows on the console from Airflow's output."""

import pytest

from trainforge.cli.runner_console import ConsoleFilter, console_line


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
        "2026-11-29T20:07:50.100000Z [info     ] [shakespeare-llm-train-t1-dc7ff02cca] "
        "[default1]:RuntimeError: [/w/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[trainforge.triggers.TrainingJobTrigger] loc=triggers.py:98":
            "    RuntimeError: [/w/gloo/transport/tcp/pair.cc:553] Connection closed by peer",
        "2026-11-29T20:07:50.200000Z [info     ] [shakespeare-llm-train-t1-dc7ff02cca] "
        "[default1]:Traceback (most recent call last): "
        "[trainforge.triggers.TrainingJobTrigger] loc=triggers.py:98":
            "    Traceback (most recent call last):",
        "2026-11-29T20:06:29.227360Z [info     ] Task instance state updated    "
        "[airflow.api_fastapi.execution_api.routes.task_instances] loc=task_instances.py:485": None,
        '  File "/x/operators/tasks/prepare_data.py", line 51, in execute': None,
        "2026-11-29T20:06:30.100000Z [info     ] Launched local job k1 "
        "[airflow.task.operators.trainforge.tasks.train.TrainOperator] loc=train.py:120":
            "    Launched local job k1",
        "2026-11-29T20:06:30.200000Z [info     ] Dataset reused "
        "[trainforge.data.prepare] loc=prepare.py:80": "    Dataset reused",
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
