"""The built wheel holds every static file the pages load.

The list is the one the UI app checks when it is built (trainforge.plugins.ui.static_files:
the page shell, what it loads, what the app serves), read from the checkout's page.html: a
file deleted from the checkout, or left out by package-data, is missing from the wheel.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from tests.packaging.layout import REPO

STATIC = "trainforge/plugins/ui/static/"


def missing_from(names: set[str], page_html: str) -> list[str]:
    """The static files the pages need that a wheel listing ``names`` lacks."""
    from trainforge.plugins.ui.static_files import required

    return [name for name in required(page_html) if STATIC + name not in names]


def _page_html() -> str:
    return (REPO / "plugins" / "ui" / "static" / "page.html").read_text(encoding="utf-8")


def test_the_pages_load_their_scripts_and_stylesheet():
    from trainforge.plugins.ui.static_files import referenced

    assert referenced(_page_html()) == {"ui.css", "charts.js", "ui.js"}


def test_a_wheel_without_a_static_file_is_caught(built_wheel: Path):
    names = set(zipfile.ZipFile(built_wheel).namelist())
    assert missing_from(names - {STATIC + "ui.js"}, _page_html()) == ["ui.js"]
    assert missing_from(names - {STATIC + "page.html"}, _page_html()) == ["page.html"]


def test_the_wheel_holds_every_static_file_the_pages_load(built_wheel: Path):
    names = set(zipfile.ZipFile(built_wheel).namelist())
    assert missing_from(names, _page_html()) == [], (
        "the wheel lacks static files the pages load: check the checkout's plugins/ui/static/ "
        "and pyproject.toml's package-data for trainforge.plugins.ui")
