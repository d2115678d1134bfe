"""The ``slurm`` engine: an ``sbatch`` script that runs torchrun on every allocated node
(:mod:`.backend`; the script in :mod:`.script`)."""

from __future__ import annotations

from typing import Any

from trainforge.engines.descriptors import Engine
from trainforge.engines.slurm.spec import SlurmEngine
from trainforge.paths import resolve


def _connection(block: SlurmEngine, runs_root: str) -> dict[str, Any]:
    # Job folders live on the file system shared with the compute nodes.
    return {"runs_root": resolve(block.job_root) if block.job_root else runs_root,
            "bin_dir": block.bin_dir}


ENGINE = Engine(
    name="slurm",
    title="Slurm",
    summary="sbatch on a Slurm cluster",
    block=SlurmEngine,
    backend="trainforge.engines.slurm.backend:SlurmBackend",
    connection=_connection,
    multi_node=True,
    elastic=True,
    secrets_in_memory=False,
    written_request="batch script",
    secrets_remedy="give the nodes credentials of their own (instance role, ~/.aws, or "
    "training.slurm.setup reading them from a protected file)",
)
