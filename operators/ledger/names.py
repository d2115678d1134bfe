"""The ledger's names: buckets, metrics, tags and the JSON artifact (docs/contracts.md, "Run ledger").

Bucket names follow the badput types of Google's ml-goodput-measurement; the throughput names
follow torchtitan's metrics.
"""

from __future__ import annotations

from trainforge.contract import COMPILE_MODE_TAG

TRAINER_BUCKETS = ("program_startup", "checkpoint_restore", "data_loading", "checkpoint_save",
                   "evaluation", "compile", "wasted_progress", "recovery")
"""Known from the trainer's attempt records."""
ORCHESTRATION_BUCKETS = ("queue_wait", "image_pull", "orchestration")
"""Known from the task and the engine; an engine that cannot know one says so in a tag."""
OTHER = "other"
"""What no bucket explains: the wall time less the productive time and every known bucket."""
BUCKETS = (*TRAINER_BUCKETS, *ORCHESTRATION_BUCKETS, OTHER)

GOODPUT = "goodput/percent"
PRODUCTIVE_S = "goodput/productive_s"
WALL_S = "goodput/wall_s"
GPU_HOURS_ALLOCATED = "gpu_hours/allocated"
GPU_HOURS_PRODUCTIVE = "gpu_hours/productive"
ENERGY_KWH = "energy/kwh"
COST_ALLOCATED = "cost/allocated"
TPS = "tps"
TFLOPS = "tflops"
MFU_PCT = "mfu_pct"
DISRUPTIONS = "disruptions/count"
RECOVERY_MEAN_S = "recovery/mean_s"
RECOVERY_MAX_S = "recovery/max_s"
COMPILE_MODE = COMPILE_MODE_TAG
"""The tag saying how every attempt's steps ran, and so what ``tps``, ``tflops`` and ``mfu_pct``
measure: ``compiled``, ``eager``, or ``partly_eager`` (some eager steps, or attempts that differ)."""
CHECKPOINT_BACKGROUND_S = "checkpoint/background_write_s"
"""Seconds rank 0's writer thread spent writing checkpoints, summed over attempts; beside the buckets
(the steps went on meanwhile, except while the final one was awaited), not one of them."""
CHECKPOINT_STAGING = "checkpoint/staging"
"""The tag saying how rank 0 kept checkpoints while they were written (contract.STAGING_MODES), each
attempt's choice in order when they differ (``pageable,synchronous``)."""

OOM_COUNT = "out_of_memory/count"
"""Tries that ended in a GPU out of memory (logged only when one did)."""
OOM_TAG = "ledger/out_of_memory"
"""Those tries as JSON: try, rank, step, phase, micro_batch_size and the retry's
next_micro_batch_size (null: no retry at a smaller one)."""

TRY = "ledger/try"
"""The tag naming the task try whose outcome the logged ledger is; its metrics are at that step."""

ARTIFACT = "ledger.json"
"""The ledger as JSON on the run (a stage's ledger: ``ledger/<stage>.json`` on the DAG run's run)."""
SCHEMA = "trainforge.ledger/v1"


def badput(bucket: str) -> str:
    """The metric of one bucket, seconds: ``badput/<bucket>_s``."""
    return f"badput/{bucket}_s"


def unknown_tag(name: str) -> str:
    """The tag saying why a bucket or figure is not logged: ``ledger/<name>``."""
    return f"ledger/{name}"


def energy_source_tag(device: str) -> str:
    """``energy/source/<device kind or GPU device>`` (``gpu``, ``cpu``, ``gpu1``): measured-nvml,
    power_integration, measured-rapl, estimated, unknown, or (the ``gpu`` kind) mixed."""
    return f"energy/source/{device}"


def energy_reason_tag(device: str) -> str:
    """``energy/reason/<device kind or GPU device>``: why its energy is estimated or unknown."""
    return f"energy/reason/{device}"


ENERGY_STATUS = "energy/status"
"""``complete``, or ``partial`` when a kind or device is estimated or unknown."""
COST_STATUS = "cost/status"
"""The cost's, billed with the energy: ``partial`` when the energy is."""
