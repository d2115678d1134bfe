"""Every pipeline spec in ``dags/pipelines/`` becomes one Airflow DAG.

``TRAINFORGE_PIPELINES`` (an ``os.pathsep``-separated list of spec files or folders) replaces
the default folder; ``trainforge run FILE`` uses it to load one spec of the user's own.

A spec that does not validate never stops the other pipelines from loading: it is skipped, and
each of its errors is logged and raised as a warning attributed to the YAML file and line, which
Airflow lists with this file's import warnings. Nothing heavy is imported here (no torch, no
MLflow).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from operators.dag_builder import build_dags

_log = logging.getLogger("trainforge.dags")

_sources = os.environ.get("TRAINFORGE_PIPELINES")
_paths = _sources.split(os.pathsep) if _sources else [Path(__file__).parent / "pipelines"]
_dags, _errors = build_dags(_paths)
for _file, _error in _errors.items():
    _log.error("trainforge: pipeline %s was not loaded:\n%s", _file, _error)
    for _issue in getattr(_error, "issues", None) or [None]:
        warnings.warn_explicit(
            f"trainforge pipeline not loaded: {_issue or _error}",
            UserWarning,
            filename=_file,
            lineno=getattr(_issue, "line", 1),
        )
globals().update(_dags)
