"""The engines trainforge knows: one :class:`Engine` descriptor per engine, found by entry point.

Every engine, the four built-in ones included, is a distribution's entry point in the group
``trainforge.engines`` whose name is the engine's name (what ``training.engine`` says) and whose
object is the engine's :class:`Engine`, as TorchX finds its schedulers in ``torchx.schedulers``::

    [project.entry-points."trainforge.engines"]
    local = "trainforge.engines.local:ENGINE"

A descriptor is cheap to import (its spec block is a pydantic model; its backend is named by a
``module:attribute`` string), so the spec, the CLI and DAG parsing ask the registry without
importing an engine's client (``kubernetes``, ``ray``) or looking for its tools (``sbatch``);
:func:`get_backend` imports the backend when a job is rendered or run. docs/adding-an-engine.md
walks through a new one.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainforge.engines.base import Backend
    from trainforge.sections import SpecModel

ENTRY_POINT_GROUP = "trainforge.engines"
DEFAULT_ENGINE = "local"
"""The engine of a spec that names none."""


class EngineRegistryError(RuntimeError):
    """An installed engine entry point is broken: it does not load, is not an :class:`Engine`,
    or its name differs from the descriptor's."""


def _load(reference: str) -> Any:
    """The object named by ``"package.module:attribute"``."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Engine:
    """What trainforge knows about one engine: its names, spec block, backend and capabilities.

    Attributes:
        name: the value of ``training.engine`` and the name of its block (``training.<name>``).
        title: the engine's name in sentences ("Kubernetes").
        summary: what it runs on, for the ``training.engine`` field's description.
        block: the spec block's pydantic model (``training.<name>``); every field has a default.
        backend: ``"module:Class"`` of its :class:`~trainforge.engines.base.Backend`, imported
            only by :meth:`backend_class`.
        connection: the backend's keyword arguments from the spec's block and the folder of
            local job folders: ``connection(block, runs_root) -> dict`` (plain values that travel
            inside a trigger).
        multi_node: runs one job over several machines (``resources.nodes > 1``).
        elastic: runs a job that starts on up to ``resources.nodes.max`` machines and goes on
            with at least ``nodes.min`` after losing one (``TrainingJob.min_nodes``).
        shared_disk: the job sees the orchestrator's disk, so datasets and checkpoints may be
            local folders; False: they must be on S3, where every node can read them.
        needs_image: the job runs in the container image ``resources.image``.
        secrets_in_memory: secrets of an Airflow connection (``storage.aws_conn_id``) reach the
            ranks only through a process environment or the engine's API, never written down.
        written_request: where the job's environment is written down (shown when
            ``secrets_in_memory`` is False): "job manifest", "batch script".
        secrets_remedy: how such an engine's ranks get credentials instead.
        dev_cluster: ``"module:function"`` that gives ``trainforge run`` a cluster on this
            machine, or None: ``start(training, stack, say, env) -> dict | None`` returns the
            block values to run with (e.g. the address of a head it started, stopped when the
            ``contextlib.ExitStack`` closes; None: the spec's own), prints through
            ``say(line)``, may edit the run's ``env``, and raises
            :class:`~trainforge.errors.BackendError` when the cluster does not start.
    """

    name: str
    title: str
    summary: str
    block: type[SpecModel]
    backend: str
    connection: Callable[[Any, str], dict[str, Any]]
    multi_node: bool = False
    elastic: bool = False
    shared_disk: bool = True
    needs_image: bool = False
    secrets_in_memory: bool = True
    written_request: str = ""
    secrets_remedy: str = ""
    dev_cluster: str | None = None

    def backend_class(self) -> type[Backend]:
        """The backend class, imported now (with the engine's client where it has one)."""
        return _load(self.backend)

    def dev_cluster_starter(self) -> Callable[..., dict[str, Any] | None] | None:
        """The ``dev_cluster`` function, imported now, or None."""
        return _load(self.dev_cluster) if self.dev_cluster else None


@functools.cache
def _engines() -> dict[str, Engine]:
    """Every installed engine by name: :data:`DEFAULT_ENGINE` first, then by name (entry points
    come in no order that survives packaging)."""
    found: dict[str, Engine] = {}
    seen: dict[str, str] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in seen:
            if seen[point.name] != point.value:
                raise EngineRegistryError(
                    f"engine {point.name!r} is registered twice, as {seen[point.name]!r} and "
                    f"{point.value!r} (expected one entry point per engine name in group "
                    f"{ENTRY_POINT_GROUP!r})")
            continue  # the same distribution seen twice on sys.path
        try:
            engine = point.load()
        except Exception as err:  # noqa: BLE001 - any import error of a third-party engine
            raise EngineRegistryError(
                f"engine entry point {point.name} = {point.value!r} does not load: {err}"
            ) from err
        if not isinstance(engine, Engine) or engine.name != point.name:
            raise EngineRegistryError(
                f"engine entry point {point.name} = {point.value!r} is not the Engine named "
                f"{point.name!r} (got {engine!r})")
        seen[point.name] = point.value
        found[point.name] = engine
    return {name: found[name] for name in sorted(found, key=lambda n: (n != DEFAULT_ENGINE, n))}


def engine_names() -> tuple[str, ...]:
    """The names of the installed engines (``training.engine``'s choices)."""
    return tuple(_engines())


def engines() -> tuple[Engine, ...]:
    """The installed engines' descriptors, in :func:`engine_names` order."""
    return tuple(_engines().values())


def get_engine(name: str) -> Engine:
    """The descriptor of engine ``name``.

    Raises:
        ValueError: no installed engine has that name.
    """
    try:
        return _engines()[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; expected one of "
                         f"{', '.join(engine_names())}") from None


def get_backend(engine: str, **kwargs: Any) -> Backend:
    """The backend for ``engine``, built from plain keyword values (as a trigger carries them).

    Raises:
        ValueError: the engine is unknown.
    """
    return get_engine(engine).backend_class()(**kwargs)


def backend_kwargs(training: Any, runs_root: str) -> dict[str, Any]:
    """Plain keyword arguments of :func:`get_backend` for a spec's ``training`` section.

    Only where and how to reach the engine (these travel inside the trigger); what to run is
    in the :class:`~trainforge.engines.base.TrainingJob`.
    """
    return get_engine(training.engine).connection(training.engine_block, runs_root)
