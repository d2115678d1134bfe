"""The Ray engine's development cluster for ``trainforge run``: a Ray job API that answers, else
a single-machine head started for the run (:class:`~trainforge.engines.ray.head.LocalRayHead`).

:func:`start_dev_cluster` is what the engine's descriptor names as ``dev_cluster``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from trainforge.engines.ray.head import LocalRayHead, RayHeadError, job_api_ready
from trainforge.errors import BackendError


def start_dev_cluster(training: Any, stack: contextlib.ExitStack, say: Callable[[str], Any],
                      env: dict[str, str]) -> dict[str, Any] | None:
    """The ``training.ray`` values the run uses: the address of a job API that answers
    (``RAY_API_SERVER_ADDRESS``, ``RAY_ADDRESS``, the spec's address), else of a head started
    here; None when the spec names an Airflow connection (used as it is).

    A head started here is stopped when ``stack`` closes; ``RAY_ADDRESS`` and
    ``RAY_API_SERVER_ADDRESS`` are then removed from ``env`` (Ray's client would prefer them).
    ``say`` prints one line for the user.

    Raises:
        BackendError: the head did not start (the message carries the end of its log).
    """
    block = training.engine_block
    if block.connection_id:
        return None
    for address in (os.environ.get("RAY_API_SERVER_ADDRESS"), os.environ.get("RAY_ADDRESS"),
                    block.address):
        if address and address.startswith(("http://", "https://")) and job_api_ready(address):
            say(f"Ray cluster: {address}")
            return {"address": address.rstrip("/")}
    resources = training.resources
    if resources.max_nodes > 1:
        raise BackendError(
            f"resources.nodes is {resources.nodes}, but a Ray head started here is one Ray node "
            f"(expected a cluster of at least {resources.max_nodes} Ray nodes: set "
            f"training.ray.address or RAY_ADDRESS to its job API, see docs/ray.md)")
    cpus = max(os.cpu_count() or 1, resources.processes_per_node * resources.cpus_per_process)
    # Short: Ray's socket paths below it must stay under 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="tf-ray-")
    stack.callback(shutil.rmtree, temp_dir, True)
    say(f"Starting a Ray head on loopback ({cpus} CPUs; temp dir {temp_dir})")
    try:
        head = stack.enter_context(LocalRayHead(temp_dir, num_cpus=cpus))
    except RayHeadError as err:
        raise BackendError(f"could not start a local Ray head: {err}") from err
    stack.callback(say, f"Stopping the Ray head on {head.address}")
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(name, None)
    say(f"Ray head: {head.address} (job API and dashboard; stopped at the end)")
    return {"address": head.address}
