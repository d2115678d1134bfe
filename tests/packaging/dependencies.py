"""A wheel's runtime dependencies, placed into a fresh venv from this environment's installed files.

The wheel test installs the wheel into a fresh venv outside the checkout. Downloading and
unpacking its ~200 locked dependencies (Airflow, MLflow, torch, ...) again for every run of the
suite took minutes and proved nothing ``make venv`` has not proved already: the same pins from
the same ``requirements.lock``. So :func:`place_dependencies` puts into the fresh venv exactly
the distributions the wheel's own ``Requires-Dist`` needs (its transitive closure, markers and
extras evaluated, each at a version its requirement allows), file by file from their ``RECORD``
in this environment, hard-linked where the file system allows. Nothing else of this environment
comes along: not the test tools, not the editable ``trainforge``, not the checkout; a runtime
import the wheel does not declare still fails in the fresh venv. pip then installs the wheel
itself, resolving its requirements against what is there, with no index.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """``Requires-Dist`` of a wheel's METADATA, as written in the wheel file."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(name).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def _applies(requirement: Requirement, extras: frozenset[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in (extras or {""}))


def _site_packages() -> list[str]:
    """This environment's own site-packages folders. Not ``sys.path``: a package imported earlier
    in the process may have put its vendored copies there (Ray adds ``ray/thirdparty_files``,
    which holds a psutil), and placing such a copy would put it where nothing finds it."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def _distribution(name: str) -> metadata.Distribution:
    """The installed distribution ``name`` of this environment's site-packages."""
    found = next(iter(metadata.Distribution.discover(name=name, path=_site_packages())), None)
    if found is None:
        raise metadata.PackageNotFoundError(name)
    return found


def dependency_closure(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """This environment's distributions that ``requirements`` need, transitively (each with the
    extras asked of it). A requirement that no installed distribution satisfies is an error
    naming it: the fresh venv would lack it."""
    wanted: dict[str, frozenset[str]] = {}
    found: dict[str, metadata.Distribution] = {}
    todo = [(requirement, frozenset[str]()) for requirement in requirements]
    while todo:
        requirement, parent_extras = todo.pop()
        if not _applies(requirement, parent_extras):
            continue
        key = canonicalize_name(requirement.name)
        extras = frozenset(requirement.extras) | wanted.get(key, frozenset())
        if key in wanted and extras == wanted[key]:
            continue
        try:
            dist = found.get(key) or _distribution(requirement.name)
        except metadata.PackageNotFoundError:
            raise LookupError(f"{requirement}: not installed in {sys.prefix}") from None
        if not requirement.specifier.contains(dist.version, prereleases=True):
            raise LookupError(f"{requirement}: {sys.prefix} has {dist.version}")
        wanted[key], found[key] = extras, dist
        todo.extend((Requirement(line), extras) for line in dist.requires or ())
    return list(found.values())


def _place(source: Path, target: Path, python: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        return
    if source.parent.name == "bin" and source.parent.parent == Path(sys.prefix):
        head = source.read_bytes()
        first, _, rest = head.partition(b"\n")
        if first.startswith(b"#!") and b"python" in first:
            # A console script: its shebang names this environment's interpreter.
            target.write_bytes(b"#!" + str(python).encode() + b"\n" + rest)
            target.chmod(source.stat().st_mode)
            return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _remove_replaced(venv: Path, names: set[str]) -> None:
    """Delete the files of the fresh venv's own distributions that the closure brings in another
    version of (``python -m venv`` seeds setuptools), so that each is installed once."""
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for dist in metadata.distributions(path=[str(site)]):
        if canonicalize_name(dist.metadata["Name"]) in names:
            files = dist.files or ()
            for file in files:
                Path(dist.locate_file(file)).unlink(missing_ok=True)
            for folder in {file.parts[0] for file in files}:
                if folder.endswith(".dist-info"):
                    shutil.rmtree(site / folder, ignore_errors=True)


def place_dependencies(wheel: Path, venv: Path, extras: frozenset[str] = frozenset()) -> list[str]:
    """Put the wheel's dependency closure (:func:`dependency_closure`; with ``extras``, those
    extras' requirements too) into the fresh ``venv`` (made by ``python -m venv``, same Python
    version); return the distributions' names."""
    return place_requirements([_unmarked(r) for r in wheel_requirements(wheel)
                               if _applies(r, extras)], venv)


def _unmarked(requirement: Requirement) -> Requirement:
    """``requirement`` without its marker, once evaluated: the closure evaluates a top-level
    marker again with no extra, so an extra's own requirements would drop out there."""
    copy = Requirement(str(requirement))
    copy.marker = None
    return copy


def place_requirements(requirements: list[Requirement], venv: Path) -> list[str]:
    """Put the closure of ``requirements`` into the fresh ``venv``; return the names."""
    python = venv / "bin" / "python"
    closure = dependency_closure(requirements)
    _remove_replaced(venv, {canonicalize_name(dist.metadata["Name"]) for dist in closure})
    names = []
    for dist in closure:
        names.append(dist.metadata["Name"])
        for file in dist.files or ():
            source = Path(os.path.normpath(dist.locate_file(file)))
            if not source.is_file():
                continue  # RECORD names files an installer may leave out (e.g. .pyc)
            try:
                relative = source.relative_to(sys.prefix)
            except ValueError:
                raise LookupError(f"{dist.metadata['Name']}: {source} lies outside "
                                  f"{sys.prefix}") from None
            _place(source, venv / relative, python)
    return sorted(names)
