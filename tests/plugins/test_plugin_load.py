"""The plugin reports an unsupported Airflow or MLflow instead of loading.

The ranges are what the installed trainforge distribution declares (Requires-Dist); the check is
trainforge.plugins.compat, run in the plugin's ``on_load``. The last tests run Airflow's own
plugins manager (its uncached loader, so the process's loaded plugins stay as they were) with
``importlib.metadata`` answering another version, and read what it records.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from trainforge.plugins import compat

REQUIRES = ["apache-airflow>=3.1.0,<4", "mlflow==3.17.2", "torch>=2.6",
            'apache-airflow[celery]>=3.2; extra == "deploy"', 'pytest==9.2.0; extra == "test"']


@pytest.fixture
def fake_metadata(monkeypatch):
    """compat reads this fake distribution: ``REQUIRES``, and the versions given to it."""
    versions: dict[str, str] = {}

    def version(name: str) -> str:
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(compat.metadata, "requires", lambda dist: REQUIRES)
    monkeypatch.setattr(compat.metadata, "version", version)
    return versions


def test_the_ranges_are_the_unconditional_requirements(fake_metadata):
    ranges = compat.declared_ranges()
    assert ranges["apache-airflow"] == SpecifierSet(">=3.1.0,<4")  # not the deploy extra's
    assert ranges["mlflow"] == SpecifierSet("==3.17.2")
    assert "pytest" not in ranges


@pytest.mark.parametrize("airflow, mlflow, fragment", [
    ("3.1.0", "3.17.2", None),
    ("3.9.9", "3.17.2", None),
    ("3.0.6", "3.17.2", "apache-airflow 3.0.6 is installed; trainforge supports "
                        "apache-airflow<4,>=3.1.0"),
    ("4.0.0", "3.17.2", "apache-airflow 4.0.0 is installed"),
    ("3.2.0", "3.16.0", "mlflow 3.16.0 is installed; trainforge supports mlflow==3.17.2"),
    ("3.2.0", None, "mlflow is not installed; trainforge requires mlflow==3.17.2"),
])
def test_versions_outside_the_ranges_are_named(fake_metadata, airflow, mlflow, fragment):
    fake_metadata.update({"apache-airflow": airflow, **({"mlflow": mlflow} if mlflow else {})})
    if fragment is None:
        compat.check_supported()
        return
    with pytest.raises(compat.UnsupportedVersion, match="trainforge plugin not loaded") as err:
        compat.check_supported()
    assert fragment in str(err.value)


def _load_plugins(monkeypatch, package: str | None, version: str = "") -> tuple[list, dict]:
    """Airflow's plugins manager loading every plugin, ``package`` seen at ``version``."""
    from airflow import plugins_manager
    from airflow._shared.module_loading import _get_grouped_entry_points

    # A setuptools build leaves trainforge.egg-info in the checkout, on sys.path in tests: the
    # entry point would be found twice and the second "already registered" would overwrite the
    # first's error under the same key. An installed deployment has one distribution.
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if not (Path(p or ".") / "trainforge.egg-info").exists()])
    if package:
        real = metadata.version
        monkeypatch.setattr(metadata, "version",
                            lambda name: version if name == package else real(name))
    _get_grouped_entry_points.cache_clear()  # Airflow's entry point list, read again below
    try:
        return plugins_manager._get_plugins.__wrapped__()
    finally:
        _get_grouped_entry_points.cache_clear()


@pytest.mark.parametrize("package, version", [("apache-airflow", "3.0.0"), ("mlflow", "2.22.0")])
def test_an_unsupported_version_is_a_plugin_import_error(monkeypatch, package, version):
    declared = compat.declared_ranges()[package]
    plugins, errors = _load_plugins(monkeypatch, package, version)
    assert "trainforge" not in [p.name for p in plugins]
    [message] = [m for m in errors.values() if "trainforge plugin not loaded" in m]
    assert f"{package} {version} is installed; trainforge supports {package}{declared}" in message


def test_the_installed_versions_load_the_plugin(monkeypatch):
    plugins, errors = _load_plugins(monkeypatch, None)
    assert "trainforge" in [p.name for p in plugins]
    assert not [m for m in errors.values() if "trainforge" in m], errors
