"""The pages' app as the plugin hands it to Airflow: built on its first request.

Every Airflow process loads the plugin (scheduler, triggerer, each task's runner), but only the
API server serves the pages; importing trainforge.plugins.ui.app (Airflow's API security, the ORM
models) costs about two seconds, so the plugin gives Airflow this thin ASGI app instead.
"""

from __future__ import annotations

import threading
from typing import Any

URL_PREFIX = "/trainforge"


class LazyApp:
    """An ASGI app that imports and calls trainforge.plugins.ui.app's FastAPI app when first used."""

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._app is None:
                from trainforge.plugins.ui.app import app

                self._app = app
        return self._app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await (self._app or self._load())(scope, receive, send)


ui_app = LazyApp()
