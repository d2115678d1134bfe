"""Every pipeline spec in ``dags/pipelines/`` becomes one Airflow DAG.

``TRAINFORGE_PIPELINES`` (an ``os.pathsep``-separated list of spec files or folders) replaces
the default folder; ``trainforge run FILE`` uses it to load one spec of the user's own.

A spec that does not validate is skipped, its errors logged with file, line and field; the
other pipelines still load. Nothing heavy is imported here (no torch, no MLflow).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from operators.dag_builder import build_dags

_log = logging.getLogger("trainforge.dags")

_sources = os.environ.get("TRAINFORGE_PIPELINES")
_paths = _sources.split(os.pathsep) if _sources else [Path(__file__).parent / "pipelines"]
_dags, _errors = build_dags(_paths)
for _file, _message in _errors.items():
    _log.error("trainforge: pipeline %s was not loaded:\n%s", _file, _message)
globals().update(_dags)
