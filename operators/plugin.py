"""The Airflow plugin of trainforge, registered by the ``airflow.plugins`` entry point.

Airflow's plugins manager loads it from the installed distribution, so an API server, scheduler
or triggerer with only the wheel installed shows the extra links on trainforge tasks; no file in
a plugins folder is needed.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from trainforge.links import MlflowRunLink
from trainforge.webhooks import app as webhook_app


class TrainforgePlugin(AirflowPlugin):
    name = "trainforge"
    operator_extra_links = [MlflowRunLink()]
    fastapi_apps = [
        # MLflow registry webhooks -> asset events (trainforge.webhooks.app, docs/registry.md)
        {"app": webhook_app.app, "url_prefix": webhook_app.URL_PREFIX,
         "name": "trainforge MLflow webhooks"},
    ]
