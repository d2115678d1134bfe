"""`trainforge doctor`: the installed packages against what trainforge needs, one line per problem.

Checked: each ``Requires-Dist`` of the installed trainforge distribution within its declared range
(the base ones, and those of every extra whose packages are all installed); the installed
transformers not older than the installed MLflow's transformers flavour takes (its
``ml_package_versions.py``, read without importing MLflow; newer than it was tested with is a note
line, exit 0); transformers seeing torch and the torch
features a spec asks for (trainforge.trainer.env_check, which the trainer runs at start); the
plugin's entry point importing. DAG files run the metadata-only part while they are parsed
(`require_environment`): nothing is imported. Ranges are the distribution's, never written here.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from trainforge.errors import EnvironmentConflict
from trainforge.trainer import env_check
from trainforge.trainer.env_check import FEATURES, asked_features, feature_problems, transformers_torch_problem

__all__ = ["FEATURES", "Installed", "flavour_note", "problems", "require_environment", "spec_features", "summary"]

DISTRIBUTION = "trainforge"
SHOWN = ("apache-airflow", "mlflow", "transformers", "torch", "pydantic")
"""The packages whose versions the OK summary names."""
FLAVOUR_TABLE = "ml_package_versions.py"
"""The file of the mlflow package holding ``_ML_PACKAGE_VERSIONS``, each flavour's tested range."""
_EXTRA = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")


class Installed(env_check.Installed):
    """What is installed: importlib.metadata, MLflow's flavour table, transformers (tests override)."""

    def flavour_range(self, flavour: str) -> tuple[str, str] | None:
        """``(minimum, maximum)`` of the ``models`` versions MLflow tested for ``flavour``, from the
        installed MLflow's table; None where MLflow or the table is not found."""
        spec = importlib.util.find_spec("mlflow")  # a top-level package: found, not imported
        if spec is None or not spec.submodule_search_locations:
            return None
        try:
            models = _flavour_table(Path(spec.submodule_search_locations[0]) / FLAVOUR_TABLE)[flavour]["models"]
            return str(models["minimum"]), str(models["maximum"])
        except (OSError, SyntaxError, ValueError, StopIteration, KeyError, TypeError):
            return None


def _flavour_table(path: Path) -> dict:
    """``_ML_PACKAGE_VERSIONS`` of MLflow's table at ``path``: a JSON literal, parsed as JSON (a
    fraction of the cost of Python's parse) unless it is not one."""
    text = path.read_text("utf-8")
    start = text.find("=", text.index("\n_ML_PACKAGE_VERSIONS") + 1) + 1
    try:
        return json.JSONDecoder().raw_decode(text[start:].lstrip())[0]
    except ValueError:
        tree = ast.parse(text)
        return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == "_ML_PACKAGE_VERSIONS" for t in node.targets))


def _shown(specifier: SpecifierSet) -> str:
    """``>=3.2.0,<4``: lower bounds first."""
    return ",".join(sorted(map(str, specifier), key=lambda s: (not s.startswith((">", "=", "~")), s)))


def _inside(found: str, specifier: SpecifierSet) -> bool:
    try:
        return specifier.contains(Version(found), prereleases=True)
    except InvalidVersion:
        return False


def requirement_problems(installed: Installed, extras: bool = True,
                         distribution: str = DISTRIBUTION) -> list[str]:
    """One line per requirement of ``distribution`` outside its range or not installed.

    Requirements whose markers do not apply here are skipped; an extra's only when ``extras`` and
    every package it names is installed (the extra counts as installed). [] when ``distribution``
    itself is not installed (code run from a checkout).
    """
    base: list[Requirement] = []
    by_extra: dict[str, list[Requirement]] = {}
    for line in installed.requires(distribution) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            base.append(req)
            continue
        for extra in _EXTRA.findall(str(req.marker)):
            if req.marker.evaluate({"extra": extra}):
                by_extra.setdefault(extra, []).append(req)
    checked = [(req, distribution) for req in base]
    if extras:
        for extra, reqs in sorted(by_extra.items()):
            if all(installed.version(req.name) is not None for req in reqs):
                checked += [(req, f"{distribution}[{extra}]") for req in reqs]
    problems = []
    for req, who in checked:
        found, need = installed.version(req.name), f"{req.name}{_shown(req.specifier)}"
        if found is None:
            problems.append(f"{req.name} is not installed; {who} needs {need}")
        elif not _inside(found, req.specifier):
            problems.append(f"{req.name} {found} is installed; {who} needs {need}")
    return problems


def _flavour_position(installed: Installed) -> tuple[str, str, str, str, int] | None:
    """``(transformers, mlflow, minimum, maximum, side)``: side -1 below MLflow's tested range, 0
    inside it, 1 above it; None where either package or the table is missing."""
    transformers, mlflow = installed.version("transformers"), installed.version("mlflow")
    tested = installed.flavour_range("transformers") if transformers and mlflow else None
    if tested is None:
        return None
    low, high = tested
    try:
        found = Version(transformers)
        side = -1 if found < Version(low) else 1 if found > Version(high) else 0
    except InvalidVersion:
        return None
    return transformers, mlflow, low, high, side


def flavour_problem(installed: Installed) -> str | None:
    """Where the installed transformers is older than the installed MLflow's transformers flavour
    takes (MLflow refuses to save it)."""
    position = _flavour_position(installed)
    if position is None or position[4] >= 0:
        return None
    transformers, mlflow, low, high, _ = position
    return (f"transformers {transformers} is installed; MLflow {mlflow}'s transformers flavour supports "
            f"transformers>={low},<={high} (registering a model fails below it): install a transformers in "
            "that range")


def flavour_note(installed: Installed) -> str | None:
    """Where the installed transformers is newer than MLflow's flavour was tested with: a note, not a
    problem (MLflow itself only warns; trainforge's own range stops below the releases known to
    fail to register, docs/install.md)."""
    position = _flavour_position(installed)
    if position is None or position[4] <= 0:
        return None
    transformers, mlflow, _, high, _ = position
    return (f"note: transformers {transformers} is newer than MLflow {mlflow}'s transformers flavour was "
            f"tested with (up to {high}); trainforge's range excludes the releases known to fail to register")


def plugin_problem() -> str | None:
    """Why the plugin's ``airflow.plugins`` entry point does not import, or None (loaded as Airflow
    loads it, so nothing here names the plugin's modules)."""
    try:
        points = [ep for ep in metadata.distribution(DISTRIBUTION).entry_points if ep.group == "airflow.plugins"]
    except metadata.PackageNotFoundError:
        return None
    for point in points:
        try:
            point.load()
        except Exception as err:  # noqa: BLE001 - whatever stops the import is the finding
            return f"the trainforge plugin ({point.value}) does not import: {type(err).__name__}: {err}"
    return None


def spec_features(spec) -> dict[str, str]:
    """Torch feature -> the setting of a validated spec (each stage's training) that asks for it."""
    from trainforge.pipeline.stages import resolve_stages

    asked: dict[str, str] = {}
    for stage in resolve_stages(spec):
        where = f"stage {stage.name}: training.framework" if stage.name else "training.framework"
        for feature, why in asked_features(stage.training.framework.model_dump(), where).items():
            asked.setdefault(feature, why)
    return asked


def problems(asked: Mapping[str, str] | None = None, plugin: bool = True,
             installed: Installed | None = None) -> list[str]:
    """Every problem `trainforge doctor` reports; ``asked``: torch feature -> what asks for it."""
    installed = installed or Installed()
    if installed.requires(DISTRIBUTION) is None:
        return [f"{DISTRIBUTION} is not installed as a distribution, so its declared ranges cannot be read: "
                "install the wheel (or `pip install -e .`)"]
    found = requirement_problems(installed)
    found += [p for p in (flavour_problem(installed), transformers_torch_problem(installed)) if p]
    if asked:
        found += feature_problems(asked, installed)
    if plugin and (problem := plugin_problem()):
        found.append(problem)
    return found


def summary(installed: Installed | None = None, asked: Iterable[str] = ()) -> str:
    """The OK line: the versions found, MLflow's flavour maximum and the features checked."""
    installed = installed or Installed()
    versions = ", ".join(f"{name} {installed.version(name)}" for name in SHOWN)
    tested = installed.flavour_range("transformers")
    flavour = f"MLflow's transformers flavour up to {tested[1]}" if tested else "MLflow's flavour table not found"
    features = f"; torch features: {', '.join(sorted(set(asked)))}" if asked else ""
    return (f"ok: {DISTRIBUTION} {installed.version(DISTRIBUTION)} with {versions}; {flavour}; "
            f"transformers sees torch{features}")


def require_environment(installed: Installed | None = None) -> None:
    """Raise unless the metadata-only checks pass: what a DAG file runs while it is parsed.

    Raises:
        EnvironmentConflict: naming each problem (package, version found, range needed).
    """
    installed = installed or Installed()
    found = requirement_problems(installed, extras=False)
    found += [p for p in (flavour_problem(installed), transformers_torch_problem(installed, runtime=False)) if p]
    if found:
        raise EnvironmentConflict(
            f"the installed packages conflict with what trainforge needs, so its pipelines do not load: "
            f"{'; '.join(found)}. `trainforge doctor` lists every problem; fix the installation, then "
            "restart Airflow's components.")
