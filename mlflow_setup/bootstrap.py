"""Create the experiments and registered models a deployment expects, idempotently.

    python -m trainforge.mlflow_setup bootstrap --tracking-uri http://127.0.0.1:5000 \
        --experiment trainforge --registered-model "shakespeare-llm=Tiny Shakespeare LM"
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainforge.mlflow_setup.errors import MlflowSetupError

if TYPE_CHECKING:  # mlflow is imported lazily: importing this module stays cheap
    from mlflow import MlflowClient

log = logging.getLogger(__name__)


class BootstrapError(MlflowSetupError):
    """An experiment or registered model could not be created or checked."""

    def __init__(self, tracking_uri: str, what: str, name: str, cause: str) -> None:
        self.tracking_uri = tracking_uri
        self.what = what
        self.name = name
        super().__init__(f"could not bootstrap {what} {name!r} on {tracking_uri}: {cause}")


@dataclass
class BootstrapResult:
    """Experiment ids by name, registered model names, and what this call created."""

    experiment_ids: dict[str, str] = field(default_factory=dict)
    registered_models: list[str] = field(default_factory=list)
    created: list[str] = field(
        default_factory=list
    )  # "experiment:<name>", "registered_model:<name>"


def bootstrap(
    tracking_uri: str,
    experiments: Iterable[str] = (),
    registered_models: Iterable[tuple[str, str | None]] = (),
) -> BootstrapResult:
    """Make sure each experiment and registered model exists; safe to run any number of times.

    A deleted experiment of the same name is restored (MLflow keeps deleted names reserved).
    A registered model that exists keeps its versions; its description is set when given and
    different.

    Raises:
        BootstrapError: the server refused a call (message has MLflow's error code and text).
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    result = BootstrapResult()
    for name in experiments:
        try:
            result.experiment_ids[name] = _ensure_experiment(client, name, result)
        except MlflowException as err:
            raise BootstrapError(tracking_uri, "experiment", name, _describe(err)) from err
    for name, description in registered_models:
        try:
            _ensure_registered_model(client, name, description, result)
        except MlflowException as err:
            raise BootstrapError(tracking_uri, "registered model", name, _describe(err)) from err
        result.registered_models.append(name)
    return result


def _ensure_experiment(client: MlflowClient, name: str, result: BootstrapResult) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
            log.info("restored deleted experiment %r (id %s)", name, experiment.experiment_id)
        return str(experiment.experiment_id)
    try:
        experiment_id = client.create_experiment(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        # Another bootstrap created it between our lookup and our create.
        return str(client.get_experiment_by_name(name).experiment_id)
    result.created.append(f"experiment:{name}")
    log.info("created experiment %r (id %s)", name, experiment_id)
    return str(experiment_id)


def _ensure_registered_model(
    client: MlflowClient,
    name: str,
    description: str | None,
    result: BootstrapResult,
) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description=description)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        existing = client.get_registered_model(name)
        if description is not None and (existing.description or "") != description:
            client.update_registered_model(name, description=description)
            log.info("updated description of registered model %r", name)
        return
    result.created.append(f"registered_model:{name}")
    log.info("created registered model %r", name)


def _describe(err: Exception) -> str:
    code = getattr(err, "error_code", None)
    return f"{code}: {err}" if code else str(err)
