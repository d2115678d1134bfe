"""Cluster engines behind one contract (:mod:`trainforge.backends.base`).

Engine modules are imported only when used, so parsing a DAG never imports an engine's client
(``kubernetes``, ``ray``) or looks for an engine's tools (``sbatch``).
"""

from __future__ import annotations

from typing import Any

from trainforge.backends.base import Backend

ENGINES = ("local", "kubernetes", "ray", "slurm")


def get_backend(engine: str, **kwargs: Any) -> Backend:
    """The backend for ``engine``, built from plain keyword values (as a trigger carries them).

    Raises:
        ValueError: the engine is unknown.
    """
    if engine == "local":
        from trainforge.backends.local import LocalBackend

        return LocalBackend(**kwargs)
    if engine == "kubernetes":
        from trainforge.backends.kubernetes import KubernetesBackend

        return KubernetesBackend(**kwargs)
    if engine == "ray":
        from trainforge.backends.ray import RayBackend

        return RayBackend(**kwargs)
    if engine == "slurm":
        from trainforge.backends.slurm import SlurmBackend

        return SlurmBackend(**kwargs)
    raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


def backend_kwargs(training: Any, runs_root: str) -> dict[str, Any]:
    """Plain keyword arguments of :func:`get_backend` for a spec's ``training`` section.

    Only where and how to reach the engine (these travel inside the trigger); what to run is
    in the :class:`~trainforge.backends.base.TrainingJob`.
    """
    engine = training.engine
    if engine == "local":
        return {"runs_root": runs_root}
    block = training.engine_block
    if engine == "kubernetes":
        return {"namespace": block.namespace, "conn_id": block.connection_id,
                "kubeconfig": block.kubeconfig, "context": block.context}
    if engine == "ray":
        return {"address": block.address, "conn_id": block.connection_id}
    if engine == "slurm":
        from trainforge.paths import resolve

        # Job folders live on the file system shared with the compute nodes.
        return {"runs_root": resolve(block.job_root) if block.job_root else runs_root,
                "bin_dir": block.bin_dir}
    raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
