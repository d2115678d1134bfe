"""The ``local`` engine: torchrun on the Airflow worker's own machine (:mod:`.backend`)."""

from __future__ import annotations

from typing import Any

from trainforge.engines.local.spec import LocalEngine
from trainforge.engines.descriptors import Engine


def _connection(block: LocalEngine, runs_root: str) -> dict[str, Any]:
    return {"runs_root": runs_root}


ENGINE = Engine(
    name="local",
    title="Local",
    summary="torchrun on the Airflow worker's machine",
    block=LocalEngine,
    backend="trainforge.engines.local.backend:LocalBackend",
    connection=_connection,
)
