"""The model card's link to the DAG run in the Airflow UI (set only where ``[api] base_url`` is)."""

from __future__ import annotations

import pytest

from trainforge.model_card import airflow_run_url


def test_the_run_link_quotes_the_run_id_under_the_configured_base_url(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow.example:8080/")
    url = airflow_run_url("tiny dag", "manual__2026-12-06T06:52:11.225555+00:00")
    assert url == ("http://airflow.example:8080/dags/tiny%20dag/runs/"
                   "manual__2026-12-06T06%3A52%3A11.225555%2B00%3A00")


def test_no_base_url_no_link(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "")
    assert airflow_run_url("tiny", "manual__1") == ""
