"""The Airflow plugin of trainforge, registered by the ``airflow.plugins`` entry point.

Airflow's plugins manager loads it from the installed distribution, so an API server, scheduler
or triggerer with only the wheel installed shows the extra links on trainforge tasks; no file in
a plugins folder is needed.

It also mounts the Training, run and Cluster pages (trainforge.plugins.ui) on the API server and shows
them in Airflow's UI: Training and Cluster in the navigation, the run view on a DAG run; and the
receiver of MLflow registry webhooks (trainforge.plugins.webhooks), which turns alias moves into asset
events. Its listener (trainforge.approval.close) closes an approval request whose task ended
without an answer, and a cleared approval task posts a fresh request.

It reports instead of crashing: an Airflow or MLflow outside the ranges the wheel declares stops
the plugin in ``on_load`` (Airflow lists the message with its plugin import errors), and pages
that cannot be built are listed there too and answer 503 (trainforge.plugins.ui.asgi).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from trainforge.approval import close as approval_close
from trainforge.plugins.compat import check_supported
from trainforge.plugins.links import MlflowRunLink
from trainforge.plugins.ui.asgi import URL_PREFIX, ui_app
from trainforge.plugins.webhooks import app as webhook_app

UI_APP = {"app": ui_app, "url_prefix": URL_PREFIX, "name": "trainforge training pages"}
UI_VIEWS = [
    {"name": "Training", "href": f"{URL_PREFIX}/training", "destination": "nav",
     "url_route": "trainforge-training", "nav_top_level": True},
    {"name": "Cluster", "href": f"{URL_PREFIX}/cluster", "destination": "nav",
     "url_route": "trainforge-cluster", "nav_top_level": True},
    {"name": "Training run", "href": f"{URL_PREFIX}/run?dag_id={{DAG_ID}}&run_id={{RUN_ID}}",
     "destination": "dag_run", "url_route": "trainforge-run"},
]


class TrainforgePlugin(AirflowPlugin):
    name = "trainforge"
    operator_extra_links = [MlflowRunLink()]
    fastapi_apps = [
        UI_APP,
        # MLflow registry webhooks -> asset events (trainforge.plugins.webhooks.app, docs/registry.md)
        {"app": webhook_app.app, "url_prefix": webhook_app.URL_PREFIX,
         "name": "trainforge MLflow webhooks"},
    ]
    external_views = UI_VIEWS
    listeners = [approval_close]

    @classmethod
    def on_load(cls, *args, **kwargs) -> None:
        """Raises trainforge.plugins.compat.UnsupportedVersion for an Airflow or MLflow outside
        the declared ranges: the plugins manager records it and loads nothing of the plugin."""
        check_supported()
        approval_close.install_clear_hook()
