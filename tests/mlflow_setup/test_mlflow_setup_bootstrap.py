"""trainforge.mlflow_setup.bootstrap against the session's real MLflow server."""

from __future__ import annotations

import uuid

import pytest

from trainforge.mlflow_setup import bootstrap

pytestmark = pytest.mark.integration


def test_bootstrap_is_idempotent(mlflow_server: str) -> None:
    from mlflow import MlflowClient

    suffix = uuid.uuid4().hex[:8]
    experiment, model = f"exp-{suffix}", f"llm-{suffix}"
    first = bootstrap(mlflow_server, [experiment], [(model, "Tiny Shakespeare LM")])
    again = bootstrap(mlflow_server, [experiment], [(model, "Tiny Shakespeare LM v2")])
    assert first.created == [f"experiment:{experiment}", f"registered_model:{model}"]
    assert again.created == []
    assert again.experiment_ids == first.experiment_ids
    client = MlflowClient(mlflow_server, mlflow_server)
    assert client.get_registered_model(model).description == "Tiny Shakespeare LM v2"


def test_bootstrap_restores_a_deleted_experiment(mlflow_server: str) -> None:
    from mlflow import MlflowClient

    name = f"exp-{uuid.uuid4().hex[:8]}"
    client = MlflowClient(mlflow_server, mlflow_server)
    experiment_id = client.create_experiment(name)
    client.delete_experiment(experiment_id)
    result = bootstrap(mlflow_server, [name])
    assert result.experiment_ids == {name: experiment_id}
    assert client.get_experiment(experiment_id).lifecycle_stage == "active"
