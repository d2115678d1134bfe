"""The installed layout as pyproject.toml declares it: which folder each `trainforge` package comes
from (setuptools' ``package-dir`` mapping) and a copy of the package tree as a wheel installs it."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def setuptools_config() -> dict:
    """``[tool.setuptools]`` of the checkout's pyproject.toml."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def source_folder(package: str, package_dir: dict[str, str]) -> Path:
    """The checkout folder a dotted ``package`` is built from, by the longest ``package-dir`` key
    that is the package or one of its parents (``trainforge.trainer`` -> ``trainer/``,
    ``trainforge.pipeline`` -> ``operators/pipeline/``)."""
    keys = [k for k in package_dir if package == k or package.startswith(k + ".")]
    if not keys:
        raise ValueError(f"no package-dir entry maps {package!r} (got {sorted(package_dir)})")
    key = max(keys, key=len)
    return REPO.joinpath(package_dir[key], *package[len(key):].split(".")[1:])


def copy_installed_tree(dest: Path) -> Path:
    """Copy the Python files of every listed package to where a wheel installs them, under
    ``dest`` (``dest/trainforge/...``), and return ``dest``: a folder to put on ``sys.path`` that
    holds the package exactly as installed, without building a wheel."""
    config = setuptools_config()
    for package in config["packages"]:
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in source_folder(package, config["package-dir"]).glob("*.py"):
            shutil.copy2(source, target / source.name)
    return dest
