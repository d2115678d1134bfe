"""Error answers a person can read: an HTML page for a page, JSON for the pages' data routes.

:func:`http_error` answers the UI app's refusals (401, 403, 404): the JSON Airflow's own API
gives for ``/api/`` routes and static files, a small HTML page for the pages shown in Airflow's
iframe. :class:`Unavailable` is the app mounted in place of the UI when it cannot be built: 503
for every request, naming the cause, and never any data. No template may render a value as HTML:
everything shown is escaped.
"""

from __future__ import annotations

import html
from typing import Any

from fastapi.exception_handlers import http_exception_handler
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'self'")
"""The pages' Content-Security-Policy (trainforge.plugins.ui.app sets it on every answer)."""

TITLES = {401: "Not signed in", 403: "Forbidden", 404: "Not found",
          503: "Training pages unavailable"}


def is_page(path: str) -> bool:
    """Whether a path (below the app's mount) is a page, not data: not ``/api/``, not static."""
    return "/api/" not in path and "/static/" not in path


def error_page(status_code: int, message: str, hint: str = "",
               stylesheet: str | None = None, headers: dict[str, str] | None = None
               ) -> HTMLResponse:
    """A short HTML page: the status as a title, ``message`` and ``hint`` as paragraphs."""
    title = TITLES.get(status_code, f"HTTP {status_code}")
    link = f'<link rel="stylesheet" href="{html.escape(stylesheet)}">\n' if stylesheet else ""
    body = (f"<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<meta name=\"color-scheme\" content=\"light dark\">\n"
            f"<title>{html.escape(title)} · trainforge</title>\n{link}</head>\n<body>\n"
            f"<main id=\"app\" data-error=\"{status_code}\">\n<h1>{html.escape(title)}</h1>\n"
            f"<p class=\"banner\" id=\"error\">{html.escape(message)}</p>\n"
            + (f"<p class=\"muted\">{html.escape(hint)}</p>\n" if hint else "")
            + "</main>\n</body>\n</html>\n")
    return HTMLResponse(body, status_code=status_code, headers=headers)


HINTS = {401: "Sign in to Airflow, then open this page again.",
         403: "Ask an Airflow admin for read access to this DAG's runs.",
         404: ""}


async def http_error(request: Request, exc: Any) -> Response:
    """The UI app's handler of HTTPException: HTML for pages, Airflow's JSON otherwise."""
    if not isinstance(exc, HTTPException) or not is_page(request.url.path):
        return await http_exception_handler(request, exc)
    # The page is below the mount ("<prefix>/run"): its stylesheet is "static/ui.css" beside it.
    return error_page(exc.status_code, str(exc.detail), HINTS.get(exc.status_code, ""),
                      stylesheet="static/ui.css", headers=getattr(exc, "headers", None))


class Unavailable:
    """The ASGI app answering 503 to every request when the UI cannot be built (fail closed).

    Pages get an HTML page naming ``cause``; everything else a JSON ``{"detail"}``."""

    def __init__(self, cause: str) -> None:
        self.cause = cause

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # lifespan and websockets: nothing to serve
        message = f"The training pages cannot be built: {self.cause}"
        headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-store",
                   "X-Content-Type-Options": "nosniff"}
        if is_page(scope.get("path", "")):
            response: Response = error_page(
                503, message, "Airflow lists this under plugin import errors. Fix the "
                "installation, then restart the API server.", headers=headers)
        else:
            response = JSONResponse({"detail": message}, status_code=503, headers=headers)
        await response(scope, receive, send)
