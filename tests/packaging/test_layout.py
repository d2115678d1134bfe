"""The package list and the wheel hold exactly the brief's folders under the one import root."""

from __future__ import annotations

import configparser
import zipfile
from pathlib import Path

from tests.packaging.layout import REPO, setuptools_config, source_folder


def _package_folders() -> set[str]:
    """Dotted name of every folder with an ``__init__.py`` under the folders ``package-dir``
    maps (operators/ -> trainforge, trainer/ -> trainforge.trainer, ...)."""
    found = set()
    for root_name, folder in setuptools_config()["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((root_name, *parts)))
    return found


def test_packages_list_every_package_folder():
    listed = set(setuptools_config()["packages"])
    assert listed == _package_folders(), (
        "pyproject.toml [tool.setuptools] packages must list every folder with an __init__.py: "
        f"missing {sorted(_package_folders() - listed)}, extra {sorted(listed - _package_folders())}")


def test_every_listed_package_comes_from_a_folder_with_an_init():
    config = setuptools_config()
    for package in config["packages"]:
        assert (source_folder(package, config["package-dir"]) / "__init__.py").is_file(), package


def test_wheel_holds_only_trainforge(built_wheel: Path):
    names = zipfile.ZipFile(built_wheel).namelist()
    dist_info = "-".join(built_wheel.name.split("-")[:2]) + ".dist-info/"  # trainforge-0.1.0
    outside = [n for n in names if not n.startswith(("trainforge/", dist_info))]
    assert outside == [], f"the wheel installs files outside trainforge/: {outside}"


def test_wheel_holds_every_source_file(built_wheel: Path):
    names = set(zipfile.ZipFile(built_wheel).namelist())
    config = setuptools_config()
    expected = {
        "/".join((*package.split("."), source.name))
        for package in config["packages"]
        for source in source_folder(package, config["package-dir"]).glob("*.py")
    }
    assert expected - names == set()
    assert "trainforge/pipeline/pipeline.schema.json" in names


def test_wheel_registers_the_plugin_and_the_cli(built_wheel: Path):
    with zipfile.ZipFile(built_wheel) as wheel:
        (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(wheel.read(entry_points).decode())
    assert dict(parser["airflow.plugins"]) == {"trainforge": "trainforge.plugins.plugin:TrainforgePlugin"}
    assert dict(parser["console_scripts"]) == {"trainforge": "trainforge.cli.main:app"}


def test_every_image_that_builds_the_wheel_copies_every_mapped_folder():
    """The images build the wheel from the folders their Dockerfile copies: a folder that
    ``package-dir`` maps but a Dockerfile leaves out fails the image build, minutes into it."""
    folders = set(setuptools_config()["package-dir"].values())
    for dockerfile in sorted((REPO / "docker").glob("*.Dockerfile")):
        text = dockerfile.read_text()
        if "COPY pyproject.toml" not in text:
            continue
        copied = {line.split()[1].rstrip("/") for line in text.splitlines()
                  if line.startswith("COPY ") and not line.startswith("COPY --")}
        assert folders <= copied, f"{dockerfile.name} does not copy {sorted(folders - copied)}"
