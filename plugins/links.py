"""Extra links on trainforge tasks in the Airflow UI.

The URL is computed while the task runs and kept in XCom (key :data:`XCOM_MLFLOW_RUN_URL`),
so the UI needs no MLflow call; any failure gives an empty link, never a broken page.
"""

from __future__ import annotations

import logging

from airflow.sdk import BaseOperatorLink

XCOM_MLFLOW_RUN_URL = "mlflow_run_url"

log = logging.getLogger(__name__)


class MlflowRunLink(BaseOperatorLink):
    """Link from a task to the DAG run's MLflow run."""

    name = "MLflow run"

    def get_link(self, operator, *, ti_key) -> str:
        try:
            from airflow.providers.common.compat.sdk import XCom

            return XCom.get_value(ti_key=ti_key, key=XCOM_MLFLOW_RUN_URL) or ""
        except Exception:  # noqa: BLE001 - UI code never breaks the UI
            log.debug("no MLflow run link for %s", ti_key, exc_info=True)
            return ""
