"""The contract every engine meets: render → submit → status → logs → cancel.

A backend turns a :class:`TrainingJob` (what to run, independent of where) into the engine's own
request with :meth:`Backend.render` — a pure function whose result is exactly what
:meth:`Backend.submit` sends — and then manages the job through a :class:`JobHandle`, a small
JSON-able value that the operator stores in XCom and the trigger carries across deferral.

Job identity is deterministic from (dag_id, run_id, task_id) plus the try number, so a retry can
find the earlier attempt's job.
"""

from __future__ import annotations

import abc
import enum
import hashlib
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from trainforge.contract import FailureKind

class JobState(str, enum.Enum):
    """Neutral job state; each backend maps its engine's raw states onto these."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class JobIdentity:
    """Who a job belongs to. ``try_number`` is the Airflow try that launched it."""

    dag_id: str
    run_id: str
    task_id: str
    try_number: int = 1

    @property
    def key(self) -> str:
        """A short, filesystem- and DNS-safe name, deterministic and unique per identity.

        Readable prefix from the ids, then 10 hex digits of SHA-256 over the full identity so that
        two runs whose sanitised names collide still differ.
        """
        full = f"{self.dag_id}\x00{self.run_id}\x00{self.task_id}\x00{self.try_number}"
        digest = hashlib.sha256(full.encode()).hexdigest()[:10]
        slug = re.sub(r"[^a-z0-9]+", "-", f"{self.dag_id}-{self.task_id}".lower()).strip("-")
        return f"{slug[:40]}-t{self.try_number}-{digest}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainingJob:
    """What to run, independent of the engine.

    Attributes:
        identity: who the job belongs to.
        module: Python module run under torchrun (``trainforge.trainer.train``).
        config: the job config (docs/contracts.md "Job config"), written to ``job.json``.
        nodes: number of machines (an elastic job's most).
        min_nodes: an elastic job's fewest machines (``resources.nodes: {min, max}``): it starts
            on what the engine allocates between the two and goes on without a lost node while
            at least ``min_nodes`` remain. None: exactly ``nodes``.
        processes_per_node: ranks per machine (torchrun ``--nproc-per-node``).
        env: extra environment of every rank (MLflow tracking URI and run id, ...).
        max_restarts: torchrun elastic restarts of the whole group.
        threads_per_process: ``OMP_NUM_THREADS`` of each rank.
        gpus_per_node: GPUs requested per machine (``nvidia.com/gpu`` on Kubernetes).
        memory_gib: memory per machine in GiB, or None for the engine's default.
        image: the trainer's container image (cluster engines), or None.
        engine_options: the spec's block for this engine (``training.<engine>``) as plain data:
            what the request carries besides size (queue, tolerations, runtime env, ...).
        max_runtime_s: the longest the job may run (``fault.run_timeout``), seconds; engines
            that support it enforce it on their side too (``activeDeadlineSeconds``).
        startup_timeout_s: the longest the job may wait to be admitted and start
            (``fault.startup_timeout``), seconds; engines with a queue fail the job after it with
            the engine's own reason and delete what they created. None: no limit.
        secret_env: environment of every rank that is never written down (S3 keys from an
            Airflow connection): an engine passes it only in a process environment or its job
            API call; :meth:`Backend.render`, request files and logs show
            :meth:`secret_placeholders` instead. Engines that can only write it into a manifest
            or script refuse it.
        secret_env_source: where ``secret_env`` came from, for the placeholders (e.g.
            ``Airflow connection my_s3``).
    """

    identity: JobIdentity
    config: dict[str, Any]
    module: str = "trainforge.trainer.train"
    nodes: int = 1
    processes_per_node: int = 1
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    threads_per_process: int = 1
    gpus_per_node: int = 0
    memory_gib: float | None = None
    image: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    max_runtime_s: float | None = None
    startup_timeout_s: float | None = None
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    secret_env_source: str = ""
    min_nodes: int | None = None

    @property
    def elastic(self) -> bool:
        """The job may run on fewer machines than ``nodes`` (at least ``min_nodes``)."""
        return self.min_nodes is not None and self.min_nodes < self.nodes

    def secret_placeholders(self) -> dict[str, str]:
        """``secret_env``'s names, each with ``<from SOURCE>`` as its value: what a rendered
        request shows instead of the secret."""
        shown = f"<from {self.secret_env_source or 'a secret source'}>"
        return {name: shown for name in sorted(self.secret_env)}


@dataclass(frozen=True)
class JobStatus:
    """One observation of a job.

    ``failure`` is set only for FAILED; ``result`` is the trainer's result file when available;
    ``wall_s`` is how long the job ran (seconds), once it has ended. Once it has ended, for the
    run ledger (trainforge.ledger): ``ended_at_epoch_s`` when the engine saw it end, and
    ``phases``, the engine's part of the ledger's buckets — ``queue_wait`` (submission to the
    job's start: Kueue admission and scheduling, Slurm pending) and ``image_pull`` — each in
    seconds, or the reason the engine cannot know it ("unknown: ...", "not applicable: ...").
    """

    state: JobState
    message: str = ""
    exit_code: int | None = None
    failure: FailureKind | None = None
    result: dict[str, Any] | None = None
    wall_s: float | None = None
    ended_at_epoch_s: float | None = None
    phases: dict[str, float | str] | None = None


@dataclass(frozen=True)
class LogChunk:
    """New log lines since ``offset``; pass ``next_offset`` to the next call."""

    lines: list[str]
    next_offset: int


def whole_lines(data: bytes, offset: int, max_bytes: int) -> LogChunk:
    """The complete lines of ``data``, read at byte ``offset`` of a log, as a :class:`LogChunk`.

    A trailing partial line is left for the next read (``next_offset`` stops before it), except
    that a single line longer than ``max_bytes`` is passed on in pieces so a read always advances.
    Undecodable bytes become U+FFFD.
    """
    cut = data.rfind(b"\n")
    if cut < 0:
        if len(data) < max_bytes:
            return LogChunk([], offset)
        cut = len(data) - 1
    chunk = data[: cut + 1]
    return LogChunk(chunk.decode("utf-8", errors="replace").splitlines(), offset + len(chunk))


JobHandle = dict[str, Any]
"""A JSON-able reference to a submitted job: ``{"engine": ..., "key": ..., ...}``.

Optional key ``submitted_at_epoch_s`` (UNIX seconds): when the job was created on the engine. The
operator counts ``fault.run_timeout`` from it, so a retry that adopts an earlier job does not
reset the job's clock; without it the clock starts when the operator gets the handle.
"""


class Backend(abc.ABC):
    """One cluster engine. Implementations must keep ``render`` pure (no I/O)."""

    engine: str

    @abc.abstractmethod
    def render(self, job: TrainingJob) -> dict[str, Any]:
        """The exact request :meth:`submit` would send, as JSON-able data. Pure."""

    @abc.abstractmethod
    def submit(self, job: TrainingJob) -> JobHandle:
        """Send the rendered request; return a handle. Raises :class:`BackendError`."""

    @abc.abstractmethod
    def find(self, identity: JobIdentity) -> JobHandle | None:
        """The handle of an existing job with this identity, or None."""

    @abc.abstractmethod
    def status(self, handle: JobHandle) -> JobStatus:
        """Observe the job once. Raises :class:`BackendError` when the engine cannot be reached."""

    @abc.abstractmethod
    def read_logs(self, handle: JobHandle, offset: int, max_bytes: int = 65_536) -> LogChunk:
        """Rank-0 log lines after byte ``offset`` (at most ``max_bytes`` of them)."""

    @abc.abstractmethod
    def cancel(self, handle: JobHandle, grace_s: float = 30.0) -> JobStatus:
        """Stop the job: polite stop, then force after ``grace_s``. Idempotent."""
