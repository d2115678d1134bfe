"""The ``ray`` engine: torchrun as the entrypoint of a job on a Ray cluster's job API
(:mod:`.backend`), one torchrun per Ray node when ``resources.nodes`` > 1 (:mod:`.launcher`);
:mod:`.dev` gives ``trainforge run`` a single-machine cluster (:mod:`.head`)."""

from __future__ import annotations

from typing import Any

from trainforge.engines.ray.spec import RayEngine
from trainforge.engines.descriptors import Engine


def _connection(block: RayEngine, runs_root: str) -> dict[str, Any]:
    return {"address": block.address, "conn_id": block.connection_id}


ENGINE = Engine(
    name="ray",
    title="Ray",
    summary="Ray job API",
    block=RayEngine,
    backend="trainforge.engines.ray.backend:RayBackend",
    connection=_connection,
    multi_node=True,
    dev_cluster="trainforge.engines.ray.dev:start_dev_cluster",
)
