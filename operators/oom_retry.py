"""What a GPU out of memory does to the ``train`` task: ``training.fault.on_oom`` (docs/faults.md,
"A GPU out of memory is named").

The trainer names the out of memory (exit 80, result status ``out_of_memory`` with an ``oom``
record: rank, step, phase, memory asked for and free, the micro-batch it ran at). At the try's end
`oom_policy` decides: ``fail`` fails the task without retries, saying what to change;
``shrink_micro_batch`` makes the failure transient and names the micro-batch of the retry
(`trainforge.contract.shrunk_micro_batch`), which goes into the try record (``oom``). The next
try's job config gets its ``retry`` section from those records (`retry_section`).
"""

from __future__ import annotations

import logging
from typing import Any

from trainforge.contract import STATUS_OOM, shrunk_micro_batch
from trainforge.ledger.tries import TryRecordError, earlier_tries

SHRINK = "shrink_micro_batch"


def oom_policy(event: dict[str, Any], on_oom: str) -> dict[str, Any]:
    """The event as ``training.fault.on_oom`` has the task see it: unchanged unless the trainer
    ran out of GPU memory; then permanent (``fail``, or the micro-batch is at its floor) or
    transient with the retry's micro-batch, and ``oom``: the trainer's record with ``policy`` and
    ``next_micro_batch_size`` (None when there is no retry at a smaller one)."""
    result = event.get("result") or {}
    if event.get("status") != "error" or result.get("status") != STATUS_OOM:
        return event
    record = dict(result.get("oom") or {})
    micro, accum = record.get("micro_batch_size"), record.get("grad_accum_steps")
    smaller = shrunk_micro_batch(micro) if on_oom == SHRINK and isinstance(micro, int) else None
    record.update(policy=on_oom, next_micro_batch_size=smaller)
    said = f"training.fault.on_oom is {on_oom!r}"
    if smaller is None:
        remedy = (f"lower training.optimization.micro_batch_size (now {micro}) or set "
                  f"training.fault.on_oom: {SHRINK}" if on_oom != SHRINK else
                  f"the micro-batch is {micro}, its floor: lower data.sequence_length or the model's "
                  f"size, or set training.framework.activation_checkpointing: true or parallelism: fsdp")
        return {**event, "failure": "permanent", "oom": record,
                "message": f"{event['message']}; {said}: {remedy}"}
    accum_then = accum * (micro // smaller) if isinstance(accum, int) else "more"
    return {**event, "failure": "transient", "oom": record,
            "message": f"{event['message']}; {said}: the retry trains at micro-batch {smaller} x "
                       f"accumulation {accum_then} (the same global batch), resuming the newest "
                       f"checkpoint"}


def shrunk_by_earlier_tries(records: list[dict[str, Any]], micro_batch_size: int) -> int | None:
    """The micro-batch the latest earlier try that ran out of memory asked its retry to train at
    (``records``: the try records, oldest first), if it is below the spec's ``micro_batch_size``
    and divides it; else None."""
    for record in reversed(records):
        smaller = (record.get("oom") or {}).get("next_micro_batch_size")
        if isinstance(smaller, int) and 0 < smaller < micro_batch_size and micro_batch_size % smaller == 0:
            return smaller
    return None


def retry_section(tags: Any, try_number: int, training: Any, log: logging.Logger) -> dict[str, int] | None:
    """The job config's ``retry`` section of try ``try_number`` (``tags()``: the run's tags, read
    only under ``shrink_micro_batch``), or None: the spec's micro-batch."""
    if training.fault.on_oom != SHRINK or try_number <= 1:
        return None
    micro = training.optimization.micro_batch_size
    try:
        smaller = shrunk_by_earlier_tries(earlier_tries(tags(), try_number), micro)
    except TryRecordError as err:
        log.warning("could not read the earlier tries' records (%s): this try trains at the spec's "
                    "micro-batch %d", err, micro)
        return None
    if smaller is None:
        return None
    log.info("Try %d trains at micro-batch %d (the spec's: %d), the same global batch: an earlier try ran "
             "out of GPU memory (training.fault.on_oom: %s)", try_number, smaller, micro, SHRINK)
    return {"micro_batch_size": smaller}
