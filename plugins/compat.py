"""Whether the installed Airflow and MLflow are ones the trainforge wheel supports.

The ranges are the ones the installed ``trainforge`` distribution declares (its ``Requires-Dist``,
written from pyproject.toml's dependencies): read here, never declared a second time. The plugin
checks them when Airflow's plugins manager loads it, so a deployment outside them sees a named
plugin import error instead of pages that fail later. Reads package metadata only; imports neither.
"""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "trainforge"
CHECKED = ("apache-airflow", "mlflow")
"""The packages whose versions the plugin's code depends on at run time."""


class UnsupportedVersion(RuntimeError):
    """An installed package lies outside the range the trainforge distribution declares."""


def declared_ranges(distribution: str = DISTRIBUTION) -> dict[str, SpecifierSet]:
    """Package name -> the version range of its unconditional ``Requires-Dist`` (no extra).

    An empty dict when the distribution is not installed (code run from a checkout)."""
    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return {}
    ranges: dict[str, SpecifierSet] = {}
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or one for another platform
        name = req.name.lower()
        ranges[name] = ranges.get(name, SpecifierSet()) & req.specifier
    return ranges


def check_supported(packages: tuple[str, ...] = CHECKED,
                    distribution: str = DISTRIBUTION) -> None:
    """Raise unless each of ``packages`` is installed at a version its declared range contains.

    Raises:
        UnsupportedVersion: names the package, the installed version (or "not installed") and
            the range, for each package outside it.
    """
    ranges = declared_ranges(distribution)
    problems = []
    for name in packages:
        spec = ranges.get(name)
        if spec is None:
            continue  # not a requirement of this distribution: nothing declared to check
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed; {distribution} requires {name}{spec}")
            continue
        try:
            inside = spec.contains(Version(installed), prereleases=True)
        except InvalidVersion:
            inside = False
        if not inside:
            problems.append(f"{name} {installed} is installed; {distribution} supports "
                            f"{name}{spec}")
    if problems:
        raise UnsupportedVersion(
            f"trainforge plugin not loaded: {'; '.join(problems)} (the {distribution} "
            "distribution's Requires-Dist). Install a supported version, or a trainforge "
            "release that supports this one.")
