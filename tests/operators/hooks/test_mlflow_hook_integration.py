"""MlflowHook against a real MLflow server on loopback (tests/conftest.py::mlflow_server)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trainforge.hooks.errors import MlflowParamConflictError
from trainforge.hooks.mlflow import DATASET_CONTEXT_TAG, TAG_DATASET_DIGEST, MlflowHook
from trainforge.hooks.mlflow_runs import TAG_AIRFLOW_RUN_ID, TAG_DAG_ID

pytestmark = pytest.mark.integration

DAG_ID = "shakespeare.tiny"
AIRFLOW_RUN_ID = "manual__2026-01-01T00:00:00+00:00"


def _runs_of(hook: MlflowHook, experiment: str, run_id: str = AIRFLOW_RUN_ID) -> list[str]:
    experiment_id = hook.client.get_experiment_by_name(experiment).experiment_id
    runs = hook.client.search_runs(
        [experiment_id], f"tags.`{TAG_AIRFLOW_RUN_ID}` = '{run_id}'", max_results=100
    )
    return [r.info.run_id for r in runs]


def test_get_or_create_run_is_idempotent(hook: MlflowHook, unique_name: str) -> None:
    first = hook.get_or_create_run(unique_name, DAG_ID, AIRFLOW_RUN_ID, {"try_number": 1})
    again = hook.get_or_create_run(unique_name, DAG_ID, AIRFLOW_RUN_ID, {"try_number": 2})
    other = hook.get_or_create_run(unique_name, DAG_ID, "scheduled__2026-01-02")
    assert again == first != other
    run = hook.client.get_run(first)
    assert run.data.tags[TAG_DAG_ID] == DAG_ID
    assert run.data.tags[TAG_AIRFLOW_RUN_ID] == AIRFLOW_RUN_ID
    assert run.data.tags["try_number"] == "2"
    assert run.info.run_name == "shakespeare.tiny/manual__2026-01-01T00_00_00_00_00"
    assert _runs_of(hook, unique_name) == [first]


def test_concurrent_callers_end_with_one_run(mlflow_server: str, unique_name: str) -> None:
    # Threads of one process (Airflow's task runners in one worker): they take turns. Between
    # processes the search-create-search protocol narrows the race but cannot close it (MLflow
    # has no create-if-absent), so that case is not asserted here.
    MlflowHook(tracking_uri=mlflow_server)._experiment_id(unique_name)  # no experiment race here

    def call(_: int) -> str:
        return MlflowHook(tracking_uri=mlflow_server).get_or_create_run(
            unique_name, DAG_ID, AIRFLOW_RUN_ID
        )

    with ThreadPoolExecutor(max_workers=4) as pool:
        run_ids = set(pool.map(call, range(4)))
    assert len(run_ids) == 1
    assert _runs_of(MlflowHook(tracking_uri=mlflow_server), unique_name) == list(run_ids)


def test_params_metrics_tags_and_artifacts(hook: MlflowHook, unique_name: str) -> None:
    run_id = hook.get_or_create_run(unique_name, DAG_ID, AIRFLOW_RUN_ID)
    params = {"learning_rate": 0.003, "max_steps": 300, "precision": "fp32"}
    hook.log_params(run_id, params)
    hook.log_params(run_id, params)  # a retry re-logs the same values
    with pytest.raises(MlflowParamConflictError, match="max_steps: logged '300', given '400'"):
        hook.log_params(run_id, {**params, "max_steps": 400})
    hook.log_metrics(run_id, {"val_loss": 4.5}, step=100)
    hook.log_metrics(run_id, {"val_loss": 4.1}, step=200)
    hook.set_tags(run_id, {"trainforge.try_number.train": 2})
    uri = hook.log_dict_artifact(run_id, {"ok": True, "step": 200}, "validation/report.json")

    run = hook.client.get_run(run_id)
    assert run.data.params == {"learning_rate": "0.003", "max_steps": "300", "precision": "fp32"}
    history = hook.client.get_metric_history(run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(100, 4.5), (200, 4.1)]
    assert run.data.tags["trainforge.try_number.train"] == "2"
    assert uri == f"runs:/{run_id}/validation/report.json"
    local = hook.client.download_artifacts(run_id, "validation/report.json")
    assert json.loads(Path(local).read_text()) == {"ok": True, "step": 200}


def test_dataset_input_is_visible_on_the_run(hook: MlflowHook, unique_name: str) -> None:
    run_id = hook.get_or_create_run(unique_name, DAG_ID, AIRFLOW_RUN_ID)
    digest = "ab" * 32  # sha256 hex: 64 characters
    for _ in range(2):  # a retry logs it again
        hook.log_dataset_input(
            run_id, "shakespeare", digest, "/data/datasets/" + digest, extra_tags={"split": "train"}
        )
    inputs = hook.client.get_run(run_id).inputs.dataset_inputs
    assert len(inputs) == 1
    dataset = inputs[0].dataset
    assert (dataset.name, dataset.digest, dataset.source_type) == (
        "shakespeare",
        digest[:36],
        "local",
    )
    assert json.loads(dataset.source) == {"uri": "/data/datasets/" + digest}
    tags = {t.key: t.value for t in inputs[0].tags}
    assert tags == {DATASET_CONTEXT_TAG: "training", TAG_DATASET_DIGEST: digest, "split": "train"}


def test_end_run(hook: MlflowHook, unique_name: str) -> None:
    run_id = hook.get_or_create_run(unique_name, DAG_ID, AIRFLOW_RUN_ID)
    hook.end_run(run_id, "FAILED")
    run = hook.client.get_run(run_id)
    assert run.info.status == "FAILED" and run.info.end_time is not None
