"""The wheel, built once per session from the checkout's tracked layout (pyproject.toml, README.md
and the folders ``package-dir`` maps), so a stale ``build/`` folder never leaks into it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.layout import REPO, setuptools_config


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of ``trainforge-<version>-py3-none-any.whl``, built with this environment's
    setuptools (``pip wheel --no-deps --no-build-isolation``: nothing is downloaded)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for folder in sorted(set(setuptools_config()["package-dir"].values())):
        shutil.copytree(REPO / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = work / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(dist), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout}{result.stderr}"
    (wheel,) = dist.glob("trainforge-*.whl")
    return wheel
