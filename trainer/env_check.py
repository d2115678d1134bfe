"""The trainer's side of `trainforge doctor`: transformers sees torch, and torch has what the job asks for.

A transformers that requires a newer torch than the one installed disables torch: the model's import
then dies with a NameError that looks transient. `refuse_conflicts` runs first in the trainer program,
before transformers' model code is imported, and exits 78 (a config error: never retried) with a
message naming both versions, or the torch feature (FSDP2, DCP, torch.compile) the job config asks
for and the installed torch lacks. Standard library only at import; torch and transformers are
imported by the checks themselves. `trainforge.doctor` runs the same checks (docs/install.md).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from typing import Any

#: feature -> (module, attribute or None, what it is), the attribute looked up after the import.
FEATURES: dict[str, tuple[str, str | None, str]] = {
    "compile": ("torch", "compile", "torch.compile"),
    "fsdp2": ("torch.distributed.fsdp", "fully_shard", "FSDP2 (torch.distributed.fsdp.fully_shard)"),
    "dcp": ("torch.distributed.checkpoint.state_dict", "get_model_state_dict",
            "DCP (torch.distributed.checkpoint)"),
    "float8": ("torchao.float8", None, "float8 training (torchao.float8)"),
}


class Installed:
    """What is installed, read through importlib.metadata (tests override the methods)."""

    def version(self, name: str) -> str | None:
        """The installed version of distribution ``name``, or None."""
        headers = _headers(name)
        return None if headers is None else headers.get("version", [None])[0]

    def requires(self, name: str) -> list[str] | None:
        """The ``Requires-Dist`` lines of distribution ``name``; None when it is not installed."""
        headers = _headers(name)
        return None if headers is None else headers.get("requires-dist", [])

    def sees_torch(self) -> bool:
        """``transformers.utils.is_torch_available()`` (imports transformers, not torch)."""
        from transformers.utils import is_torch_available

        return bool(is_torch_available())


def _headers(name: str) -> dict[str, list[str]] | None:
    """The ``Version`` and ``Requires-Dist`` headers of distribution ``name`` (lower-case keys); None
    when it is not installed. A dist-info's METADATA is scanned up to its body, a fraction of the cost
    of `importlib.metadata`'s full parse (this runs on every DAG file parse); others go through it."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    text = dist.read_text("METADATA")
    if text is None:  # an egg-info: PKG-INFO and requires.txt
        return {"version": [dist.version], "requires-dist": dist.requires or []}
    headers: dict[str, list[str]] = {}
    end = text.find("\n\n")  # the body (the long description) follows the first blank line
    for line in text[:end if end >= 0 else None].splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        if key.lower() in ("version", "requires-dist") and not line[0].isspace():
            headers.setdefault(key.lower(), []).append(value.strip())
    return headers


def needed_range(installed: Installed, package: str, dependency: str, extra: str = "") -> str | None:
    """The range of ``dependency`` that ``package``'s metadata declares (for ``extra``), e.g. ``>=2.5``."""
    from packaging.requirements import Requirement

    for line in installed.requires(package) or []:
        req = Requirement(line)
        if re.sub(r"[-_.]+", "-", req.name).lower() == dependency and (
                req.marker is None or req.marker.evaluate({"extra": extra})):
            return str(req.specifier) or None
    return None


def transformers_torch_problem(installed: Installed, runtime: bool = True) -> str | None:
    """Why transformers would not use the installed torch, or None.

    ``runtime``: ask transformers itself (`Installed.sees_torch`); else judge from transformers'
    declared torch range alone (no import: what DAG parsing may afford).
    """
    tf, torch = installed.version("transformers"), installed.version("torch")
    if tf is None or torch is None:
        return None  # reported as not installed by the range checks
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    need = needed_range(installed, "transformers", "torch", "torch")
    try:
        outside = need is not None and not SpecifierSet(need).contains(Version(torch), prereleases=True)
    except InvalidVersion:
        outside = True
    if runtime:
        try:
            if installed.sees_torch():
                return None
        except Exception as err:  # noqa: BLE001 - any failure to import transformers is the finding
            return f"transformers {tf} cannot be imported ({type(err).__name__}: {err})"
    elif not outside:
        return None
    needs = f"it needs torch{need}" if outside else "transformers.utils.is_torch_available() is False"
    return (f"transformers {tf} does not see torch {torch} ({needs}), so no model can be built: install a "
            f"torch{need if outside else ''} or a transformers that supports torch {torch}")


def asked_features(framework: Mapping[str, Any], where: str) -> dict[str, str]:
    """feature -> the setting that asks for it, for a ``framework`` section found at ``where``."""
    asked = {}
    if framework.get("compile", "auto") is not False:
        asked["compile"] = f"{where}.compile: {str(framework.get('compile', 'auto')).lower()}"
    if framework.get("parallelism") == "fsdp":
        asked["fsdp2"] = asked["dcp"] = f"{where}.parallelism: fsdp"
    if framework.get("precision") == "fp8":  # the spec's framework section; the job config's is top-level
        asked["float8"] = f"{where}.precision: fp8"
    return asked


def feature_problems(asked: Mapping[str, str], installed: Installed,
                     import_module: Callable[[str], Any] = importlib.import_module) -> list[str]:
    """One line per feature of ``asked`` (feature -> what asks for it) the installed torch lacks."""
    problems = []
    for feature, why in asked.items():
        module, attribute, what = FEATURES[feature]
        try:
            found = import_module(module)
            if attribute is not None:
                getattr(found, attribute)
            continue
        except Exception as err:  # noqa: BLE001 - whatever stops the import is the reason
            reason = f"{type(err).__name__}: {err}"
        problems.append(f"{what} is not available with torch {installed.version('torch') or '(not installed)'} "
                        f"({reason}); {why} needs it")
    return problems


def startup_problems(raw: Mapping[str, Any] | None, installed: Installed | None = None) -> list[str]:
    """What stops the trainer before its model is built: transformers not seeing torch, and the torch
    features the job config ``raw`` (its JSON object; None: unknown) asks for."""
    installed = installed or Installed()
    problem = transformers_torch_problem(installed)
    framework = raw.get("framework") if isinstance(raw, Mapping) else None
    asked = asked_features(framework, "framework") if isinstance(framework, Mapping) else {}
    if isinstance(raw, Mapping) and raw.get("precision") == "fp8":
        asked["float8"] = "precision: fp8"
    return ([problem] if problem else []) + feature_problems(asked, installed)


def _job_config(argv: Sequence[str]) -> Mapping[str, Any] | None:
    """The ``--config`` JSON object named in ``argv``; None where there is none to read (the
    trainer's own config check reports that)."""
    import json

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    path = parser.parse_known_args(list(argv))[0].config
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (TypeError, OSError, ValueError):
        return None


def refuse_conflicts(argv: Sequence[str], environ: Mapping[str, str] = os.environ,
                     installed: Installed | None = None) -> None:
    """Exit 78 (permanent) naming each `startup_problems` finding; rank 0 writes it as the result."""
    from trainforge.contract import RESULT_FILE_ENV
    from trainforge.storage.files import atomic_write_json
    from trainforge.trainer.errors import ConfigError

    problems = startup_problems(_job_config(argv), installed)
    if not problems:
        return
    message = (f"environment check: {'; '.join(problems)} (a retry cannot fix this: fix the trainer's "
               "environment; `trainforge doctor` lists every conflict)")
    rank = environ.get("RANK", "0")
    print(f"rank{rank} ConfigError (exit {ConfigError.exit_code}): {message}", file=sys.stderr, flush=True)
    if rank == "0" and environ.get(RESULT_FILE_ENV):
        atomic_write_json(environ[RESULT_FILE_ENV], {"status": ConfigError.status, "exit_code": ConfigError.exit_code,
                                                     "message": message})
    raise SystemExit(ConfigError.exit_code)
