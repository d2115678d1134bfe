"""Finding and creating MLflow runs: THE run of a DAG run (by its tags), a staged pipeline's
stage runs under it, reopening a run that ended.

:class:`DagRuns` is a part of :class:`~trainforge.hooks.mlflow.MlflowHook` (a mixin over its
``client`` and ``tracking_uri``); callers use the hook. ``mlflow`` is imported inside methods
only.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from trainforge.hooks.errors import MlflowConfigError, MlflowRequestError
from trainforge.hooks.mlflow_calls import mlflow_errors, quote

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

log = logging.getLogger(__name__)

TAG_DAG_ID = "trainforge.dag_id"
TAG_AIRFLOW_RUN_ID = "trainforge.airflow_run_id"
TAG_STAGE = "trainforge.stage"
_RUN_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._/-]+")


class DagRuns:
    """Looking up and creating runs (needs ``self.client``, ``self.tracking_uri`` and
    ``self.set_tags``)."""

    client: MlflowClient
    tracking_uri: str
    set_tags: Callable[[str, Mapping[str, Any]], None]

    def get_or_create_run(
        self,
        experiment_name: str,
        dag_id: str,
        run_id: str,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Return the id of THE MLflow run of DAG run (dag_id, run_id), creating it if missing.

        The run is found by its tags ``trainforge.dag_id`` and ``trainforge.airflow_run_id``
        (active runs only); ``tags`` are set on it either way (e.g. try numbers). Its status is
        left as found. A new run is named ``<dag_id>/<run_id>`` with unsafe characters replaced.

        Two concurrent callers: MLflow has no "create if absent", so each caller that created a
        run searches again and keeps the oldest matching run (start time, then run id: every
        caller picks the same one), deleting its own run if that is not the one. A start time is
        the client's, so a create that took it earlier may land after another caller's search: a
        caller that saw only its own run looks once more after as long as its create took.
        Callers in one process take turns (a lock per DAG run), so only other processes race.

        Raises:
            MlflowConfigError: the experiment exists but is deleted.
            MlflowInvalidArgumentError: dag_id/run_id contain both ' and ".
            MlflowRequestError: the server failed a call.
        """
        extra_tags = {k: str(v) for k, v in (tags or {}).items()}
        target = f"DAG run {dag_id}/{run_id}"
        experiment_id = self._experiment_id(experiment_name)
        with _creating(self.tracking_uri, experiment_id, dag_id, run_id):
            return self._get_or_create_run(experiment_id, dag_id, run_id, target, extra_tags)

    def _get_or_create_run(self, experiment_id: str, dag_id: str, run_id: str, target: str,
                           extra_tags: dict[str, str]) -> str:
        existing = self._runs_of_dag_run(experiment_id, dag_id, run_id)
        if existing:
            found = existing[0].info.run_id
            if extra_tags:
                self.set_tags(found, extra_tags)
            return found
        asked = time.monotonic()
        with mlflow_errors("create_run", target):
            created = self.client.create_run(
                experiment_id,
                tags={TAG_DAG_ID: dag_id, TAG_AIRFLOW_RUN_ID: run_id, **extra_tags},
                run_name=_run_name(dag_id, run_id),
            ).info.run_id
        took = time.monotonic() - asked
        matching = self._runs_of_dag_run(experiment_id, dag_id, run_id)
        if [r.info.run_id for r in matching] == [created]:  # a slower create may sort first
            time.sleep(min(max(took, 0.05), 2.0))
            matching = self._runs_of_dag_run(experiment_id, dag_id, run_id)
        winner = matching[0].info.run_id if matching else created
        if winner != created:
            log.info("MLflow run %s for %s lost a creation race to %s; deleting it",
                     created, target, winner)
            with mlflow_errors("delete_run", created):
                self.client.delete_run(created)
            if extra_tags:
                self.set_tags(winner, extra_tags)
        else:
            log.info("created MLflow run %s for %s in experiment %s",
                     created, target, experiment_id)
        return winner

    def find_run(self, experiment_name: str, dag_id: str, run_id: str) -> str | None:
        """The id of the MLflow run of DAG run (dag_id, run_id), or None; creates nothing.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        with mlflow_errors("get_experiment_by_name", f"experiment {experiment_name}"):
            experiment = self.client.get_experiment_by_name(experiment_name)
        if experiment is None:
            return None
        runs = self._runs_of_dag_run(str(experiment.experiment_id), dag_id, run_id)
        return runs[0].info.run_id if runs else None

    def get_run(self, run_id: str) -> Run:
        """The run ``run_id`` (info, params, metrics, tags).

        Raises:
            MlflowRequestError: the server failed a call (also: no such run).
        """
        with mlflow_errors("get_run", f"run {run_id}"):
            return self.client.get_run(run_id)

    def child_runs(self, run_id: str) -> list[Run]:
        """The active runs whose ``mlflow.parentRunId`` tag is ``run_id`` (a staged pipeline's
        stage runs), in the parent's experiment, oldest first; any status.

        Raises:
            MlflowInvalidArgumentError: ``run_id`` contains both ' and ".
            MlflowRequestError: the server failed a call.
        """
        with mlflow_errors("get_run", f"run {run_id}"):
            experiment_id = self.client.get_run(run_id).info.experiment_id
        query = f"tags.`mlflow.parentRunId` = {quote('run_id', run_id)}"
        with mlflow_errors("search_runs", f"child runs of run {run_id}"):
            runs = self.client.search_runs(
                [experiment_id], query, max_results=1000, order_by=["attributes.start_time ASC"]
            )
        return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))

    def get_or_create_child_run(self, parent_run_id: str, stage: str,
                                tags: Mapping[str, Any] | None = None) -> str:
        """The id of stage ``stage``'s run under ``parent_run_id`` (tags ``mlflow.parentRunId``
        and ``trainforge.stage``), created in the parent's experiment, named ``stage``, with
        ``tags``, when missing; found again by those tags on a retry.

        Raises:
            MlflowInvalidArgumentError: an id contains both ' and ".
            MlflowRequestError: the server failed a call.
        """
        with mlflow_errors("get_run", f"run {parent_run_id}"):
            experiment_id = self.client.get_run(parent_run_id).info.experiment_id
        query = (f"tags.mlflow.parentRunId = {quote('parent_run_id', parent_run_id)} and "
                 f"tags.`{TAG_STAGE}` = {quote('stage', stage)}")
        with mlflow_errors("search_runs", f"stage {stage} of run {parent_run_id}"):
            found = self.client.search_runs([experiment_id], max_results=1, filter_string=query)
        if found:
            return found[0].info.run_id
        all_tags = {"mlflow.parentRunId": parent_run_id, TAG_STAGE: stage,
                    **{str(k): str(v) for k, v in (tags or {}).items()}}
        with mlflow_errors("create_run", f"stage {stage} of run {parent_run_id}"):
            return self.client.create_run(experiment_id, tags=all_tags,
                                          run_name=stage).info.run_id

    def reopen_run(self, run_id: str) -> str | None:
        """Set a run that ended ``KILLED`` or ``FAILED`` back to ``RUNNING``; the status it had,
        or None when it was left as it was.

        Raises:
            MlflowRequestError: the server failed a call.
        """
        with mlflow_errors("get_run", f"run {run_id}"):
            status = self.client.get_run(run_id).info.status
        if status not in ("KILLED", "FAILED"):
            return None
        with mlflow_errors("update_run", f"run {run_id}"):
            self.client.update_run(run_id, status="RUNNING")
        return status

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        with mlflow_errors("get_experiment_by_name", f"experiment {name}"):
            experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return str(self.client.create_experiment(name))
            except MlflowException as err:
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise MlflowRequestError(
                        "create_experiment", f"experiment {name}", err.error_code, err.message
                    ) from err
                with mlflow_errors("get_experiment_by_name", f"experiment {name}"):
                    experiment = self.client.get_experiment_by_name(name)
        if experiment.lifecycle_stage == "deleted":
            raise MlflowConfigError(
                f"MLflow experiment {name!r} (id {experiment.experiment_id}) is deleted; restore "
                f"it (mlflow experiments restore --experiment-id {experiment.experiment_id}) or "
                "use another experiment name"
            )
        return str(experiment.experiment_id)

    def _runs_of_dag_run(self, experiment_id: str, dag_id: str, run_id: str) -> list[Run]:
        """Active runs tagged with (dag_id, run_id), oldest first (start time, then run id)."""
        query = (
            f"tags.`{TAG_DAG_ID}` = {quote('dag_id', dag_id)} "
            f"AND tags.`{TAG_AIRFLOW_RUN_ID}` = {quote('run_id', run_id)}"
        )
        with mlflow_errors("search_runs", f"DAG run {dag_id}/{run_id}"):
            runs = self.client.search_runs(
                [experiment_id], query, max_results=100, order_by=["attributes.start_time ASC"]
            )
        return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))


_CREATE_LOCKS: dict[tuple, threading.Lock] = {}
_CREATE_LOCKS_GUARD = threading.Lock()


def _creating(*key: Any) -> threading.Lock:
    """The lock callers in this process take to find or create the run of one DAG run."""
    with _CREATE_LOCKS_GUARD:
        return _CREATE_LOCKS.setdefault(key, threading.Lock())


def _run_name(dag_id: str, run_id: str) -> str:
    return _RUN_NAME_UNSAFE.sub("_", f"{dag_id}/{run_id}")[:250]


