"""The pages' app as the plugin hands it to Airflow: built when the API server starts.

Every Airflow process loads the plugin (scheduler, triggerer, each task's runner), but only the
API server serves the pages; importing trainforge.plugins.ui.app (Airflow's API security, the ORM
models) costs about two seconds, so the plugin gives Airflow this thin app instead. Airflow's API
server runs its lifespan at start (and the first request builds it where nothing did).

Building it is importing the app and its access control and checking the static files. When that
fails, the failure is listed with Airflow's plugin import errors and :class:`Unavailable`
answers every request with 503 naming the cause: the UI fails closed, never open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from importlib.resources.abc import Traversable
from typing import Any

from fastapi import FastAPI

from trainforge.plugins.ui.errors import Unavailable

URL_PREFIX = "/trainforge"
IMPORT_ERROR_SOURCE = f"trainforge: training pages ({URL_PREFIX})"
"""The key of a failed build in Airflow's plugin import errors."""

log = logging.getLogger(__name__)


def build(static_folder: Traversable | None = None) -> Any:
    """The pages' FastAPI app, once its static files are known to be installed (in
    ``static_folder`` when given: a copy of the package's static folder, for tests).

    Raises whatever the import raises (an access-control helper that fails to import) and
    trainforge.plugins.ui.static_files.MissingStaticFile."""
    from trainforge.plugins.ui import static_files

    static_files.check_installed(static_folder)
    from trainforge.plugins.ui.app import app

    return app


def record_import_error(source: str, message: str) -> None:
    """List ``message`` with Airflow's plugin import errors (what ``/api/v2/plugins/importErrors``
    and the UI's plugin errors show).

    The plugins manager records what a plugin's ``on_load`` raises; the pages are built after
    that, so the failure joins the same table, the one the API server loaded its plugins with."""
    try:
        from airflow import plugins_manager

        plugins_manager.get_import_errors()[source] = message
    except Exception:  # noqa: BLE001 - the 503 pages still say it; never fail the server
        log.exception("could not list %r with Airflow's plugin import errors", source)


class UiApp(FastAPI):
    """The ASGI app Airflow mounts: the built pages' app, or :class:`Unavailable` when the build
    fails. A FastAPI app with no routes of its own, so Airflow's API server runs its lifespan."""

    def __init__(self, builder: Callable[[], Any] = build,
                 source: str = IMPORT_ERROR_SOURCE) -> None:
        super().__init__(title="trainforge UI", docs_url=None, redoc_url=None, openapi_url=None,
                         lifespan=self._startup)
        self._builder = builder
        self._source = source
        self._target: Any = None
        self._lock = threading.Lock()

    @contextlib.asynccontextmanager
    async def _startup(self, app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(self.target)
        yield

    def target(self) -> Any:
        """The app that answers requests, built on the first call."""
        with self._lock:
            if self._target is None:
                try:
                    self._target = self._builder()
                except Exception as err:  # noqa: BLE001 - reported, and the pages answer 503
                    cause = f"{type(err).__name__}: {err}"
                    log.error("trainforge training pages unavailable: %s", cause, exc_info=True)
                    record_import_error(self._source, f"training pages not built: {cause}")
                    self._target = Unavailable(cause)
        return self._target

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await super().__call__(scope, receive, send)
            return
        await (self._target or self.target())(scope, receive, send)


ui_app = UiApp()
