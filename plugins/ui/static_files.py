"""The pages' static files: which ones the pages load, and whether the package holds them.

``page.html`` is the shell of every page; the files it loads (``static/<name>`` in a ``src`` or
``href``) and the ones the app serves (:data:`MEDIA_TYPES`) must all ship in the wheel. The UI app
checks them when it is built (a missing one is a plugin import error, trainforge.plugins.ui.asgi)
and the wheel test checks the built wheel against the same list. Reads files only.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.resources.abc import Traversable

PACKAGE = "trainforge.plugins.ui"
FOLDER = "static"
PAGE = "page.html"
MEDIA_TYPES = {"ui.js": "text/javascript", "charts.js": "text/javascript", "ui.css": "text/css"}
"""The files the app serves at ``/static/<name>``, with their media types."""

_REFERENCE = re.compile(r"""(?:src|href)\s*=\s*["']static/([^"'?#]+)""")


class MissingStaticFile(FileNotFoundError):
    """A static file the pages load is not in the installed package."""


def referenced(page_html: str) -> set[str]:
    """The static files a page loads: names of ``static/<name>`` in its ``src``/``href``."""
    return set(_REFERENCE.findall(page_html))


def read_text(name: str) -> str:
    """One static file of the installed package, as text."""
    return resources.files(PACKAGE).joinpath(FOLDER, name).read_text(encoding="utf-8")


def required(page_html: str) -> list[str]:
    """Every file the pages need: the page shell, what it loads, and what the app serves."""
    return [PAGE, *sorted(referenced(page_html) | set(MEDIA_TYPES))]


def check_installed(folder: Traversable | None = None) -> None:
    """Raise unless the installed package (or ``folder``, a copy of its static folder) holds
    every file the pages need.

    Raises:
        MissingStaticFile: names each missing file and where it was looked for.
    """
    folder = folder or resources.files(PACKAGE).joinpath(FOLDER)
    page = folder.joinpath(PAGE)
    names = required(page.read_text(encoding="utf-8")) if page.is_file() else [PAGE]
    missing = [name for name in names if not folder.joinpath(name).is_file()]
    if missing:
        raise MissingStaticFile(
            f"static file(s) {', '.join(missing)} missing from {PACKAGE}/{FOLDER} "
            f"(looked in {folder}): the pages load them; reinstall a complete trainforge wheel")
