"""Airflow plugin of trainforge: registers the extra links shown on trainforge tasks."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from operators.links import MlflowRunLink


class TrainforgePlugin(AirflowPlugin):
    name = "trainforge"
    operator_extra_links = [MlflowRunLink()]
