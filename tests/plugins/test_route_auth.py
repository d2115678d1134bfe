"""Every route the plugin mounts has its guard in its dependencies, read from the route table.

The pages' routes need Airflow's ``get_user`` (the signed-in user); the webhook route needs its
HMAC signature check (trainforge.plugins.webhooks.app.SignedDelivery), since MLflow cannot send
an Airflow token. A route added without one, or a route FastAPI cannot tell the dependencies of
(a plain Starlette route, a mount), is listed as unprotected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute


def _calls(dependant: Any) -> Iterator[Any]:
    """Every callable a route depends on, at any depth."""
    for dep in dependant.dependencies:
        yield dep.call
        yield from _calls(dep)


def unprotected(app: FastAPI, is_guard: Callable[[Any], bool]) -> list[str]:
    """The routes of ``app`` with no guard among their dependencies."""
    out = []
    for route in app.routes:
        if not isinstance(route, APIRoute):
            out.append(f"{type(route).__name__} {getattr(route, 'path', route)}")
        elif not any(is_guard(call) for call in _calls(route.dependant)):
            out.append(f"{','.join(sorted(route.methods))} {route.path}")
    return out


def _is_signed_in(call: Any) -> bool:
    from airflow.api_fastapi.core_api.security import get_user

    return call is get_user


def _is_signed_delivery(call: Any) -> bool:
    from trainforge.plugins.webhooks.app import SignedDelivery

    return isinstance(call, SignedDelivery)


def _mounted_apps() -> list[tuple[str, FastAPI]]:
    """The FastAPI apps the plugin gives Airflow; for the pages, the shell and the built app."""
    from trainforge.plugins.plugin import TrainforgePlugin
    from trainforge.plugins.ui.asgi import UiApp

    apps = []
    for entry in TrainforgePlugin.fastapi_apps:
        apps.append((entry["url_prefix"], entry["app"]))
        if isinstance(entry["app"], UiApp):
            apps.append((entry["url_prefix"], entry["app"].target()))
    return apps


def test_every_mounted_route_has_its_guard():
    from trainforge.plugins.ui.asgi import URL_PREFIX
    from trainforge.plugins.webhooks.app import URL_PREFIX as WEBHOOKS

    guards = {URL_PREFIX: _is_signed_in, WEBHOOKS: _is_signed_delivery}
    apps = _mounted_apps()
    assert sorted({prefix for prefix, _ in apps}) == sorted(guards), "a new app: give it a guard"
    walked = 0
    for prefix, app in apps:
        assert isinstance(app, FastAPI), f"{prefix}: not a FastAPI app, its routes are unknown"
        assert unprotected(app, guards[prefix]) == [], prefix
        walked += len(app.routes)
    assert walked >= 8  # the pages' seven routes and the webhook: the walk saw the real tables


def test_a_route_added_without_a_guard_is_found():
    from trainforge.plugins.ui.app import app as pages
    from trainforge.plugins.webhooks.app import create_app

    probe = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    probe.router.routes.extend(pages.routes)

    @probe.get("/api/leak")
    def leak() -> dict:
        return {}

    assert unprotected(probe, _is_signed_in) == ["GET /api/leak"]
    hooks = create_app(secret=lambda: "s")

    @hooks.post("/mlflow-unsigned")
    async def unsigned() -> dict:
        return {}

    assert unprotected(hooks, _is_signed_delivery) == ["POST /mlflow-unsigned"]
    assert unprotected(hooks, _is_signed_in) == ["POST /mlflow", "POST /mlflow-unsigned"]
