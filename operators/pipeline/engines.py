"""The spec's engine fields and engine rules, from the registered engines.

``training.engine`` accepts the name of every installed engine and ``training.<name>`` is that
engine's own block (:attr:`trainforge.engines.descriptors.Engine.block`), so an engine installed by
entry point is configured in the spec with no change here. Rules that depend on what an engine can
do are written once, against its declared capabilities: one machine or several, a fixed or an
elastic number of them, storage the job can reach, a container image, secrets that may not be
written down.

Each rule returns :func:`~trainforge.sections.field_errors` entries ``(loc, message, value,
related)``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trainforge.engines.descriptors import DEFAULT_ENGINE, engine_names, engines, get_engine


def engine_field() -> tuple[Any, Any]:
    """``training.engine``: one of the installed engines, :data:`DEFAULT_ENGINE` by default."""
    names = engine_names()
    choices = [f"{e.name!r} ({e.summary})" for e in engines()]
    choices = " or ".join(filter(None, (", ".join(choices[:-1]), choices[-1])))
    return (Literal[names], Field(  # type: ignore[valid-type]
        DEFAULT_ENGINE, description=f"Where training runs: {choices}. The block of the same "
        f"name configures it."))


def block_fields() -> dict[str, tuple[Any, Any]]:
    """``training.<name>`` for every installed engine: its block, defaults when omitted (the
    default engine's block is always there; the others are null until written)."""
    fields: dict[str, tuple[Any, Any]] = {}
    for engine in engines():
        if engine.name == DEFAULT_ENGINE:
            fields[engine.name] = (engine.block, engine.block())
        else:
            fields[engine.name] = (engine.block | None, Field(
                None, description=f"{engine.title} engine settings (engine: {engine.name})."))
    return fields


def engine_block(training: Any) -> Any:
    """The block of ``training.engine`` (its defaults when the spec omits it)."""
    return getattr(training, training.engine) or get_engine(training.engine).block()


def misplaced_blocks(training: Any, usable: Any) -> list[tuple]:
    """A block of an engine other than ``training.engine`` is a mistake, not a setting."""
    errors = []
    for block in engine_names():
        if not usable("engine", block):
            continue
        given = getattr(training, block)
        # a dumped-and-reloaded spec carries `kubernetes: null` and the default local block
        if block != training.engine and given is not None and given != type(given)():
            errors.append(((block,), f"the {block!r} block configures engine {block!r}, but "
                           f"engine is {training.engine!r} (got a {block} block; expected "
                           f"engine: {block}, or no {block} block)", None, ()))
    return errors


def size_errors(training: Any) -> list[tuple]:
    """What ``training.resources`` asks of the engine: several machines, an elastic node range,
    a container image, GPUs for NCCL."""
    engine, resources = get_engine(training.engine), training.resources
    errors = []
    if not engine.multi_node and (resources.max_nodes != 1 or resources.elastic):
        several = " or ".join(e.name for e in engines()
                              if e.multi_node and (e.elastic or not resources.elastic))
        errors.append((("resources", "nodes"), f"the {engine.name} engine runs one torchrun "
                       f"group on one machine (got resources.nodes {resources.nodes}; expected "
                       f"1; use the {several} engine for "
                       f"{'an elastic job' if resources.elastic else 'several nodes'})",
                       resources.nodes, ("engine",)))
    elif resources.elastic and not engine.elastic:
        names = " or ".join(e.name for e in engines() if e.elastic)
        which = f"the {names} engine" if names else "an engine that runs elastic jobs"
        errors.append((("resources", "nodes"), f"the {engine.name} engine runs a fixed number "
                       f"of nodes (got resources.nodes {resources.nodes}; expected a node count, "
                       f"or {which} for an elastic job)", resources.nodes, ("engine",)))
    env = getattr(engine_block(training), "env_vars", None) or {}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if resources.max_nodes > 1 and name in env and _loopback_only(env[name]):
            errors.append(((training.engine, "env_vars"), f"{name} names only the loopback "
                           f"interface, which reaches no other node (got {env[name]!r} with "
                           f"resources.nodes {resources.nodes}; expected an interface the nodes "
                           f"route to, e.g. 'eth0', or none: each node finds its own)",
                           env[name], ("resources", "nodes")))
    backend = getattr(engine_block(training), "distributed_backend", None)
    if backend == "nccl" and not resources.gpus_per_node:
        errors.append(((training.engine, "distributed_backend"), "NCCL runs on GPUs only (got "
                       "distributed_backend 'nccl' with resources.gpus_per_node 0; expected "
                       "gpus_per_node of 1 or more, or 'gloo' / 'auto' on CPU)", backend,
                       ("resources", "gpus_per_node")))
    if engine.needs_image and not resources.image:
        errors.append((("resources", "image"), f"the {engine.name} engine needs "
                       f"resources.image, the trainer's container image (got none; expected "
                       f"e.g. 'ghcr.io/acme/trainforge-trainer:0.1.0')", None, ("engine",)))
    return errors


def _loopback_only(value: str) -> bool:
    """Whether a socket interface setting can match nothing but ``lo`` (Gloo's names, NCCL's
    prefixes; an NCCL exclusion list never is)."""
    if value.startswith("^"):
        return False
    names = value.lstrip("=").split(",")
    return all(name == "lo" or (not value.startswith("=") and "lo".startswith(name) and name)
               for name in names)


def needs_s3(engine: str) -> bool:
    """Whether the engine's jobs cannot see the orchestrator's disk, so that datasets and
    checkpoints must be on S3. False for a name that is not an installed engine (its own error
    says so)."""
    return engine in engine_names() and not get_engine(engine).shared_disk


def storage_errors(engine: str, output_uri: str, checkpoint_uri: str) -> list[tuple]:
    """Nodes that do not share the Airflow worker's disk need the dataset and the checkpoints
    where every node can reach them."""
    if not needs_s3(engine):
        return []
    return [
        (loc, f"{'.'.join(loc)} must be an s3:// URI with the {engine} engine, where every node "
         f"can read it (got {value!r}; expected e.g. 's3://bucket/prefix')", value,
         ("training", "engine"))
        for loc, value in ((("data", "output_uri"), output_uri),
                           (("training", "checkpoint", "uri"), checkpoint_uri))
        if not value.startswith("s3://")
    ]


def connection_secret_errors(used: set[str], aws_conn_id: str | None) -> list[tuple]:
    """An Airflow connection's secrets reach only engines that keep them in memory; ``used``:
    the engines of the spec's stages."""
    if aws_conn_id is None:
        return []
    errors = []
    for name in sorted(used & set(engine_names())):
        engine = get_engine(name)
        if engine.secrets_in_memory:
            continue
        errors.append((("storage", "aws_conn_id"), f"storage.aws_conn_id cannot be used with "
                       f"the {name} engine: its secrets would be written into the "
                       f"{engine.written_request} (got {aws_conn_id!r}; expected null: "
                       f"{engine.secrets_remedy})", aws_conn_id, ()))
    return errors
