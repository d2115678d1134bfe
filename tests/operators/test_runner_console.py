"""What `trainforge run` shows on the console from Airflow's output."""

from operators.runner import console_line


def test_task_boundaries_trainer_lines_and_failures_are_shown_and_chatter_is_not():
    lines = {
        "2026-11-29T20:06:29.291153Z [info     ] [DAG TEST] starting task_id=train map_index=-1 "
        "[airflow.sdk.definitions.dag] loc=dag.py:1501": "==> task train",
        "2026-11-29T20:07:43.673937Z [info     ] [shakespeare-llm-train-t1-dc7ff02cca] "
        "[default0]:2026-11-29 20:07:43,513 rank0 INFO trainer.train: step 100/300 | loss 5.2 "
        "[operators.triggers.TrainingJobTrigger] loc=triggers.py:98":
            "    rank0 INFO trainer.train: step 100/300 | loss 5.2",
        "operators.data.errors.SourceNotFoundError: no files match source pattern 'x'":
            "    !! operators.data.errors.SourceNotFoundError: no files match source pattern 'x'",
        "  - eval: val_perplexity 900 does not beat the unigram baseline 560":
            "    !! - eval: val_perplexity 900 does not beat the unigram baseline 560",
        "2026-11-29T20:06:29.227360Z [info     ] Task instance state updated    "
        "[airflow.api_fastapi.execution_api.routes.task_instances] loc=task_instances.py:485": None,
        '  File "/x/operators/prepare.py", line 51, in execute': None,
    }
    for line, shown in lines.items():
        assert console_line(line) == shown, line
