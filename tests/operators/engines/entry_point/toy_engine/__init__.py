"""A toy engine from outside trainforge: its spec block, its capabilities and where its backend
is, registered only through an entry point (tests/operators/engines/test_entry_point_engine.py
writes the distribution's metadata). Its "cluster" is a folder: a job is a subfolder holding the
request, and whoever plays the cluster writes ``exit.json`` into it."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from trainforge.engines.descriptors import Engine
from trainforge.sections import SpecModel


class ToyBlock(SpecModel):
    """``training.toy``: the toy cluster's settings."""

    queue: str = Field("default", min_length=1, description="Queue the job waits in.")
    spool: str | None = Field(None, description="Folder of the toy cluster; default: the runs "
                              "folder.")


def _connection(block: ToyBlock, runs_root: str) -> dict[str, Any]:
    return {"spool": block.spool or runs_root}


ENGINE = Engine(
    name="toy",
    title="Toy",
    summary="a folder playing a cluster",
    block=ToyBlock,
    backend="toy_engine.backend:ToyBackend",
    connection=_connection,
    multi_node=True,
)
