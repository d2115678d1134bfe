"""Pages that cannot be built: a plugin import error, and 503 answers that serve no data.

The app Airflow mounts (trainforge.plugins.ui.asgi.UiApp) builds the pages at start (its
lifespan, run by TestClient as by Airflow's API server). Each case breaks one part of the build
for real: the access-control module fails to import, or a static file the pages load is missing
from the folder the build checks. What Airflow lists is read through its own import-errors route.
"""

from __future__ import annotations

import shutil
import sys
from importlib import resources

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from trainforge.plugins.ui import asgi


@pytest.fixture
def import_errors():
    """Airflow's plugin import errors as its ``/api/v2/plugins/importErrors`` route answers them;
    the test's entry is removed afterwards."""
    from airflow import plugins_manager
    from airflow.api_fastapi.core_api.routes.public.plugins import import_errors as route

    source = "trainforge: training pages (test)"
    yield source, lambda: {e.source: e.error for e in route().import_errors}
    plugins_manager.get_import_errors().pop(source, None)


@pytest.fixture
def broken_access(monkeypatch):
    """The access-control helper fails to import (as a missing or broken module would)."""
    monkeypatch.delitem(sys.modules, "trainforge.plugins.ui.app", raising=False)
    monkeypatch.setitem(sys.modules, "trainforge.plugins.ui.access", None)


def _assert_503(client: TestClient, cause: str) -> None:
    for path in ("/training", "/cluster", "/run?dag_id=d&run_id=r"):
        page = client.get(path)
        assert page.status_code == 503 and page.headers["content-type"].startswith("text/html")
        assert "<h1>Training pages unavailable</h1>" in page.text and cause in page.text
        assert "frame-ancestors 'self'" in page.headers["content-security-policy"]
    for path in ("/api/training", "/api/runs/d/r", "/api/cluster", "/api/health", "/static/ui.js"):
        data = client.get(path)
        assert data.status_code == 503, (path, data.text)
        assert cause in data.json()["detail"] and list(data.json()) == ["detail"]


def test_a_broken_access_control_import_is_reported_and_answers_503(broken_access,
                                                                      import_errors):
    source, listed = import_errors
    with TestClient(asgi.UiApp(source=source)) as client:
        assert source in listed(), "the build at start did not report"
        assert "trainforge.plugins.ui.access" in listed()[source]
        _assert_503(client, "trainforge.plugins.ui.access")


def test_a_missing_static_file_is_reported_and_answers_503(tmp_path, import_errors):
    source, listed = import_errors
    static = tmp_path / "static"
    shutil.copytree(resources.files("trainforge.plugins.ui") / "static", static)
    (static / "ui.js").unlink()
    with TestClient(asgi.UiApp(lambda: asgi.build(static), source=source)) as client:
        assert "static file(s) ui.js missing" in listed()[source]
        _assert_503(client, "ui.js missing")


def test_the_first_request_builds_where_no_lifespan_ran(broken_access, import_errors):
    source, listed = import_errors
    client = TestClient(asgi.UiApp(source=source))  # no `with`: no lifespan
    assert client.get("/api/training").status_code == 503
    assert "trainforge.plugins.ui.access" in listed()[source]


def test_a_complete_install_builds_the_pages(import_errors):
    from trainforge.plugins.ui.app import app

    source, listed = import_errors
    shell = asgi.UiApp(source=source)
    with TestClient(shell) as client:
        assert shell.target() is app and source not in listed()
        assert client.get("/api/training").status_code == 401  # the real app: auth first


def test_the_api_servers_lifespan_builds_the_pages_at_start(import_errors):
    """Mounted as Airflow mounts plugin apps, under Airflow's own lifespan: built before any
    request, so the import error is listed as soon as the API server is up."""
    from airflow.api_fastapi.app import lifespan

    source, listed = import_errors
    built = []

    def broken() -> None:
        built.append(True)
        raise ImportError("no module named 'access_helper'")

    server = FastAPI(lifespan=lifespan)
    server.mount(asgi.URL_PREFIX, asgi.UiApp(broken, source=source))
    with TestClient(server) as client:
        assert built == [True] and "no module named 'access_helper'" in listed()[source]
        assert client.get(f"{asgi.URL_PREFIX}/training").status_code == 503
    assert built == [True]  # once: the request used what the start built
