"""The job contract between the orchestrator and the trainer, in one place (docs/contracts.md).

Both sides import this module: the Airflow side to render job configs and classify how a job
ended, the trainer (:mod:`trainforge.trainer`) to read its config and report its result. It
uses the standard library only, so importing it pulls neither Airflow nor torch.

* Job config: JSON of format :data:`JOB_FORMAT`, passed as ``--config FILE`` to
  ``python -m`` :data:`TRAINER_MODULE`.
* Result file: rank 0 writes ``{"status", "exit_code", "message", ...}`` to the path in
  :data:`RESULT_FILE_ENV` when it exits; :data:`RESULT_STATUSES` lists the statuses.
* Exit codes: 0 finished, :data:`EXIT_CONFIG` (78, ``EX_CONFIG`` from sysexits.h) for a bad
  config or a dataset that does not verify, :data:`EXIT_DIVERGED` (79, trainforge's own) for a
  non-finite loss, :data:`EXIT_OOM` (80) for a GPU out of memory; all three are permanent (a
  retry cannot fix them; the ``train`` task may retry an out of memory at a smaller micro-batch:
  :func:`shrunk_micro_batch`). Any other code is transient: retried, resuming from the newest
  valid checkpoint.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from typing import Any

S3_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/.*)?$")
"""What an ``s3://bucket[/prefix]`` location looks like wherever one is given (the spec, the job
config, the MLflow server's artifact store): a valid bucket name (group 1), then any prefix."""

_S3_PARTS = re.compile(r"^s3://([^/]+)/?(.*)$")


def split_s3_uri(uri: str) -> tuple[str, str] | None:
    """``s3://bucket/key`` -> ``("bucket", "key")`` (``""`` for no key), or None when ``uri`` is
    not ``s3://`` and a bucket. It reads a location and leaves judging the bucket name to
    :data:`S3_URI`; each caller raises its own error for None."""
    match = _S3_PARTS.match(uri)
    return (match.group(1), match.group(2)) if match else None


DATASET_FORMAT = "trainforge.dataset/v1"
"""``format`` of a prepared dataset's manifest, :data:`DATASET_MANIFEST` in its folder
(docs/contracts.md, "Dataset"): data preparation writes it, the trainer reads it."""
DATASET_MANIFEST = "manifest.json"
DATASET_SPLITS = ("train", "validation")


def dataset_files(manifest: Mapping[str, Any]) -> list[str]:
    """Every file a dataset manifest lists (tokenizer, shards, an examples dataset's loss masks and
    example offsets, document indexes), the manifest itself excluded. Raises KeyError,
    TypeError or AttributeError on a manifest without them."""
    files = [manifest["tokenizer"]["file"]]
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            files.append(shard["file"])
            files += [shard[key]["file"] for key in ("loss_mask", "examples") if isinstance(shard.get(key), dict)]
        if isinstance(split.get("index"), dict):
            files.append(split["index"]["file"])
    template = (manifest.get("examples") or {}).get("chat_template")
    if isinstance(template, dict):
        files.append(template["file"])
    return files


def attention_errors(hidden_size: int, num_heads: int, num_kv_heads: int) -> list[tuple[str, str]]:
    """``(field, message)`` for each rule a spec-built model's attention shape breaks: the spec
    (``trainforge validate``) and the trainer refuse a model section by this one definition.
    ``hidden_size`` splits into ``num_heads`` heads of an even size (rotary embeddings rotate
    pairs); ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention)."""
    errors = []
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        errors.append(("num_heads", f"hidden_size={hidden_size} must be divisible by num_heads="
                       f"{num_heads} into an even head size (rotary embeddings rotate pairs)"))
    if num_heads % num_kv_heads:
        errors.append(("num_kv_heads", f"num_heads={num_heads} must be a multiple of "
                       f"num_kv_heads={num_kv_heads} (grouped-query attention)"))
    return errors


JOB_FORMAT = "trainforge.job/v1"
"""``format`` field of every job config."""

TRAINER_MODULE = "trainforge.trainer.train"
"""What torchrun runs (``-m``) on every engine."""

RESULT_FILE_ENV = "TRAINFORGE_RESULT_FILE"
"""Environment variable naming the file rank 0 writes its result to."""
JOB_DIR_ENV = "TRAINFORGE_JOB_DIR"
"""Environment variable naming the job folder (where the engine keeps it on a shared disk)."""
LEDGER_TAG_PREFIX = "trainforge.ledger.attempt."
"""Rank 0's attempt records for the run ledger: MLflow tag ``<prefix><process start, epoch ms>``
(JSON), and the same record as ``$TRAINFORGE_JOB_DIR/ledger/attempt-<ms>.json``."""
LEDGER_DIR = "ledger"
LEDGER_DIR_ENV = "TRAINFORGE_LEDGER_DIR"
"""Environment variable naming the folder where every try of a task keeps its attempt records (a
path or an ``s3://`` prefix), set by the ``train`` task: the next try, on a new job folder, still
finds them."""

#: ``model.config_overrides`` keys a spec with ``model.pretrained`` may set (dropout-like floats).
PRETRAINED_OVERRIDABLE = frozenset({"attention_dropout", "hidden_dropout", "embd_pdrop",
                                    "resid_pdrop", "attn_pdrop"})

COMPILE_FALLBACKS = ("error", "warn")
"""``framework.compile_fallback`` (spec and job config; ``error`` when absent): what hitting
Dynamo's recompile or cache-size limit does, where Dynamo would run the function eagerly from
then on. ``error`` fails the job as a bad config (exit 78); ``warn`` logs it once and trains on."""
COMPILE_MODES = ("compiled", "eager", "partly_eager")
"""How an attempt's steps ran, in its ledger record (``compiled``) and the run's MLflow tag
:data:`COMPILE_MODE_TAG`: compiled decoder layers, eager ones, or compiled until a limit was hit."""
COMPILE_MODE_TAG = "compile/mode"

STAGING_MODES = ("pinned", "pageable", "synchronous")
"""How rank 0 keeps a checkpoint's state while it is written (its attempt record's
``checkpoint_staging``, docs/trainer.md "Host memory"): pinned or pageable host copies written in
the background, or no copy (written while training waits)."""
PHASE_DIR = "phase"
"""Under the job folder: ``rank-<N>``, what rank N was doing last (``staging checkpoint step 20``),
for the engine to name an OOM kill with."""
_UNLIMITED = 2**60  # a cgroup v1 limit this high means none


def phase_file(job_dir: str, rank: int) -> str:
    """The file rank ``rank`` writes its current phase to (:data:`PHASE_DIR`)."""
    return os.path.join(job_dir, PHASE_DIR, f"rank-{rank}")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def _stat(text: str | None, key: str) -> int | None:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def cgroup_memory(pid: int | str = "self") -> dict[str, Any] | None:
    """Process ``pid``'s memory cgroup: ``{"version", "dir", "limit" (None: none), "usage" (the
    working set: usage less inactive file pages), "oom_kills"}``, cgroup v2 first, else v1's memory
    controller; None where neither can be read. The trainer sizes checkpoint staging from it, the
    local engine counts OOM kills with it."""
    groups, mounts = _read(f"/proc/{pid}/cgroup"), _read("/proc/self/mountinfo")
    if groups is None or mounts is None:
        return None
    for version in (2, 1):
        for line in groups.splitlines():
            _, controllers, path = line.split(":", 2)
            if (version == 2) != (controllers == "") or (version == 1 and "memory" not in controllers.split(",")):
                continue
            for mount in mounts.splitlines():
                fields = mount.split()
                fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
                if fstype != ("cgroup2" if version == 2 else "cgroup") or (version == 1 and "memory" not in options):
                    continue
                root = fields[3].rstrip("/")
                rel = path[len(root):] if path.startswith(root) else path
                found = _memory_files(version, fields[4] + rel)
                if found is not None:
                    return found
    return None


def _memory_files(version: int, folder: str) -> dict[str, Any] | None:
    names = (("memory.max", "memory.current", "inactive_file", "memory.events") if version == 2 else
             ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", "memory.oom_control"))
    limit, usage = _read(os.path.join(folder, names[0])), _read(os.path.join(folder, names[1]))
    if limit is None or usage is None:
        return None
    limit_n = None if limit.strip() == "max" or int(limit) >= _UNLIMITED else int(limit)
    inactive = _stat(_read(os.path.join(folder, "memory.stat")), names[2]) or 0
    return {"version": version, "dir": folder, "limit": limit_n, "usage": max(0, int(usage) - inactive),
            "oom_kills": _stat(_read(os.path.join(folder, names[3])), "oom_kill")}


EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 78
EXIT_DIVERGED = 79
EXIT_OOM = 80
EXIT_TERMINATED = 143

RANK_RECORDS_DIR = "rank_records"
"""Beside the result file (or in the job folder): one JSON per rank process, how it started and
how it ended (trainforge.trainer.rank_record writes them, trainforge.engines.root_cause reads)."""
RESTARTS_FILE = "restarts.json"
"""Beside the result file (or in the job folder): the job's attempts, counted by each attempt's
rank 0 (trainforge.trainer.restarts writes it, trainforge.engines.root_cause reads)."""

PERMANENT_EXIT_CODES = frozenset({EXIT_CONFIG, EXIT_DIVERGED, EXIT_OOM})
"""Exit codes a retry cannot fix."""

STATUS_SUCCESS = "success"
STATUS_BAD_CONFIG = "bad_config"
STATUS_DIVERGED = "diverged"
STATUS_OOM = "out_of_memory"
STATUS_ERROR = "error"
RESULT_STATUSES = (STATUS_SUCCESS, STATUS_BAD_CONFIG, STATUS_DIVERGED, STATUS_OOM, STATUS_ERROR)
PERMANENT_RESULTS = frozenset({STATUS_BAD_CONFIG, STATUS_DIVERGED, STATUS_OOM})
"""Result statuses a retry cannot fix."""

ON_OOM = ("fail", "shrink_micro_batch")
"""``training.fault.on_oom`` (``fail`` when absent): what a GPU out of memory does to the ``train``
task: fail without retries, or retry at :func:`shrunk_micro_batch` (job config ``retry``)."""
RETRY_SECTION = "retry"
"""The job config's section of how a retry runs unlike the spec (``{"micro_batch_size": m}``
after an out of memory): rendered only then, and left out of the config digest like ``identity``,
since the same global batch trains the same model."""
DIGEST_EXCLUDED = ("identity", RETRY_SECTION)
"""Job config sections the config digest leaves out."""


def shrunk_micro_batch(micro_batch_size: int) -> int | None:
    """The micro-batch a retry after an out of memory trains at: the largest divisor of
    ``micro_batch_size`` no more than half of it (4 -> 2, 6 -> 3, 3 -> 1), so the global batch
    still divides and gradient accumulation grows by the same factor; None at the floor, 1."""
    return next((m for m in range(micro_batch_size // 2, 0, -1) if micro_batch_size % m == 0), None)


class FailureKind(str, enum.Enum):
    """Whether retrying a failed job can help."""

    PERMANENT = "permanent"
    TRANSIENT = "transient"


def failure_kind(exit_code: int | None, result: Mapping[str, Any] | None = None) -> FailureKind:
    """How a failed job ended, from its exit code and the trainer's result (either may be
    unknown): permanent when the result's status or exit code, or the job's exit code, is one
    a retry cannot fix; transient otherwise (a lost node, a kill, an unknown end)."""
    result = result or {}
    if (result.get("status") in PERMANENT_RESULTS
            or result.get("exit_code") in PERMANENT_EXIT_CODES
            or exit_code in PERMANENT_EXIT_CODES):
        return FailureKind.PERMANENT
    return FailureKind.TRANSIENT
