"""The Airflow plugin of trainforge, registered by the ``airflow.plugins`` entry point.

Airflow's plugins manager loads it from the installed distribution, so an API server, scheduler
or triggerer with only the wheel installed shows the extra links on trainforge tasks; no file in
a plugins folder is needed.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from trainforge.links import MlflowRunLink


class TrainforgePlugin(AirflowPlugin):
    name = "trainforge"
    operator_extra_links = [MlflowRunLink()]
