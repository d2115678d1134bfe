"""The Celery broker's visibility timeout against the tasks that hold a worker slot for long.

With CeleryExecutor on Redis or SQS, a task message not acknowledged within the broker's
visibility timeout is delivered again, and Airflow acknowledges when the task ends: a task that
holds its worker slot longer is delivered twice while it runs. :func:`visibility_warnings` names
such tasks; ``trainforge validate`` prints them (:func:`environment_broker`) and each DAG file
logs them at parse with the deployment's own setting (:func:`deployment_broker`). The story:
docs/faults.md and the README's "Deploy".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainforge.graph import TaskKind, task_timeouts
from trainforge.pipeline.durations import format_duration

#: Airflow's Celery provider's visibility timeout for Redis and SQS brokers when none is set.
DEFAULT_VISIBILITY_TIMEOUT_S = 86_400
SECTION, KEY = "celery_broker_transport_options", "visibility_timeout"
ENV = f"AIRFLOW__{SECTION.upper()}__{KEY.upper()}"
EXECUTOR_ENV = "AIRFLOW__CORE__EXECUTOR"


@dataclass(frozen=True)
class Broker:
    """A Celery broker's visibility timeout and where the value comes from (for messages)."""

    visibility_timeout_s: int
    source: str


@dataclass(frozen=True)
class VisibilityWarning:
    """One task that may outlive the broker's visibility timeout in its worker slot."""

    task_id: str
    keys: tuple[str | int, ...]  # the spec field that sets the task's execution_timeout
    message: str

    @property
    def field(self) -> str:
        return ".".join(map(str, self.keys))


def _uses_celery(executor: str | None) -> bool:
    """Whether an Airflow ``[core] executor`` value (a list, aliases or class paths) runs
    tasks on Celery; unknown (None or empty) counts as yes."""
    return not executor or any("celery" in part.lower() for part in executor.split(","))


def _parse_seconds(value: object, source: str) -> int:
    try:
        seconds = int(float(str(value).strip()))
    except (ValueError, OverflowError):  # OverflowError: inf
        raise ValueError(f"{source}: not a number of seconds (got {value!r})") from None
    if seconds <= 0:
        raise ValueError(f"{source}: must be a positive number of seconds (got {value!r})")
    return seconds


def environment_broker(given_s: int | None = None) -> Broker | None:
    """The broker as far as this process's environment tells (``trainforge validate``).

    ``given_s`` (the command's option) first, else :data:`ENV`, else Airflow's default. None
    when :data:`EXECUTOR_ENV` names executors none of which is Celery.

    Raises:
        ValueError: :data:`ENV` is not a positive number of seconds.
    """
    if given_s is not None:
        return Broker(given_s, "given with --visibility-timeout")
    if not _uses_celery(os.environ.get(EXECUTOR_ENV)):
        return None
    if os.environ.get(ENV):
        return Broker(_parse_seconds(os.environ[ENV], ENV), ENV)
    return Broker(DEFAULT_VISIBILITY_TIMEOUT_S,
                  f"Airflow's default: [{SECTION}] {KEY} is not set here")


def deployment_broker() -> Broker | None:
    """The broker of the Airflow deployment parsing the DAG files (its configuration).

    None where its executor is not Celery, or where Airflow's configuration cannot be read.

    Raises:
        ValueError: the configured visibility timeout is not a positive number of seconds.
    """
    try:
        from airflow.configuration import conf
    except ImportError:
        return None
    executor = conf.get("core", "executor", fallback="")
    if not executor or not _uses_celery(executor):
        return None
    value = conf.get(SECTION, KEY, fallback=None)
    if value in (None, ""):
        return Broker(DEFAULT_VISIBILITY_TIMEOUT_S, f"Airflow's default: [{SECTION}] {KEY} is not set")
    return Broker(_parse_seconds(value, f"[{SECTION}] {KEY}"), f"[{SECTION}] {KEY}")


def visibility_warnings(spec, broker: Broker | None) -> list[VisibilityWarning]:
    """The tasks of a validated ``PipelineSpec`` that hold a worker slot for longer than the
    broker's visibility timeout; empty without Celery. A task without ``execution_timeout``
    is not compared (nothing bounds it; a training task always has one)."""
    if broker is None:
        return []
    limit = broker.visibility_timeout_s
    shown = format_duration(limit)
    out = []
    for task in task_timeouts(spec):
        if not task.in_worker:
            continue
        fix = ("set training.fault.deferrable: true (the wait moves to the triggerer) or "
               if task.kind is TaskKind.TRAIN else "")
        if task.seconds is not None and task.seconds > limit:
            message = (f"task {task.task_id!r} may hold a Celery worker slot for "
                       f"{format_duration(task.seconds)}, longer than the "
                       f"broker's visibility timeout of {shown} ({broker.source}): it would be "
                       f"delivered to a worker again while it runs; {fix}raise [{SECTION}] {KEY} "
                       f"to at least {task.seconds} s")
            out.append(VisibilityWarning(task.task_id, task.keys, message))
    return out
