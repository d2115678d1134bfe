"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real MLflow server on loopback for the session (SQLite store, proxied artifacts).

    Started with ``mlflow_setup`` on a free port; stopped (whole process group) at the end.
    """
    from mlflow_setup import start_server

    with start_server(tmp_path_factory.mktemp("mlflow"), port=0, timeout_s=120.0) as server:
        yield server.url
