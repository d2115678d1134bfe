"""Every pipeline spec in ``dags/pipelines/`` becomes one Airflow DAG.

A spec with its own generated DAG file next to it (``<name>.py``, written by
``python -m operators.dag_files dags/pipelines``) is compiled by that file, so that a broken spec
is that file's import error in Airflow (``airflow dags list-import-errors``, the UI's import
errors) while every other pipeline still loads. This file compiles the specs without one.

``TRAINFORGE_PIPELINES`` (an ``os.pathsep``-separated list of spec files or folders) replaces
the default folder, and this file then compiles every spec it names (the per-spec files define
nothing); ``trainforge run FILE`` uses it to load one spec of the user's own.

A spec compiled here that does not validate, or whose dag_id another spec's DAG file already
defines, never stops the other pipelines from loading: it is skipped, and each of its errors is logged and raised as a warning attributed to the YAML file
and line, which Airflow lists with this file's import warnings. Nothing heavy is imported here
(no torch, no MLflow). Valid specs are cached as validated JSON (operators.dag_files
``enable_spec_cache``), so a re-parse does not read unchanged YAML again.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from operators.dag_builder import build_dags, spec_files
from operators.dag_files import enable_spec_cache, has_companion
from operators.spec.loader import SpecError, SpecIssue, load_spec, name_position

_log = logging.getLogger("trainforge.dags")
enable_spec_cache()

_sources = os.environ.get("TRAINFORGE_PIPELINES")
_taken: dict[str, str] = {}  # dag_id -> spec file of a DAG another file of this folder defines
if _sources:
    _files = spec_files(_sources.split(os.pathsep))
else:
    _all = spec_files(Path(__file__).parent / "pipelines")
    _files = [p for p in _all if not has_companion(p)]
    for _path in (p for p in _all if has_companion(p)):
        try:
            _taken.setdefault(load_spec(_path).dag_id, str(_path))
        except (SpecError, OSError):
            continue  # its own DAG file reports it
_dags, _errors = build_dags(_files)
# A spec whose dag_id is already defined by another spec's DAG file is skipped, never two
# DAGs with one dag_id (Airflow would keep whichever file it parsed last).
for _dag_id in [d for d in _dags if d in _taken]:
    # The spec that built it (the files build_dags refused are in _errors, not re-read here).
    _file = next(str(p) for p in _files
                 if str(p) not in _errors and load_spec(p).dag_id == _dag_id)
    _line, _column = name_position(Path(_file))
    _errors[_file] = SpecError([SpecIssue(
        _file, _line, _column, "pipeline.name",
        f"dag_id {_dag_id!r} is also used by {_taken[_dag_id]} (each pipeline needs its own name)",
    )])
    del _dags[_dag_id]
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
