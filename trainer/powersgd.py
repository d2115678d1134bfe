"""PowerSGD gradient compression (``framework.gradient_compression: powersgd``) whose state checkpoints.

torch's `powerSGD_hook` keeps, per rank, state that the next step depends on (`PowerSGDState`:
error feedback, warm-start factors, iteration count, its RNG). `state_dict` turns it into values
``torch.load(weights_only=True)`` accepts and `from_state_dict` builds a new state from them; the
checkpoint holds one such file per rank (trainforge.trainer.state).

`rebuild_buckets` makes DDP lay out its buckets before a resumed attempt's first real step (one
pass on a dummy batch that communicates nothing, ``PowerSGDHook.local_only``), so that the saved
bucket-keyed dicts fit. On gloo the hook waits for each bucket's PowerSGD before the next
(``PowerSGDHook.wait_each_bucket``), keeping every rank's all-reduces in bucket order.

Why each of these, field by field: docs/trainer.md, "Parallelism and gradient compression",
"PowerSGD's state checkpoints".
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from trainforge.trainer.model import lm_loss

log = logging.getLogger(__name__)

STATE_FORMAT = "trainforge.powersgd/v1"
# What the job config sets; a saved state made with other values does not fit this attempt's.
SETTINGS = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
            "orthogonalization_epsilon", "use_error_feedback", "warm_start", "batch_tensors_with_same_shape")
_FIELDS = tuple(s for s in PowerSGDState.__slots__ if s != "process_group")  # as __getstate__ has them
_TENSOR_DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")


@dataclass
class PowerSGDHook:
    """The state DDP passes to `powersgd_hook`: torch's PowerSGD state and where it came from."""

    state: PowerSGDState
    local_only: bool = False  # True during `rebuild_buckets`: no communication, state untouched
    wait_each_bucket: bool = False  # gloo: one bucket's PowerSGD at a time (module doc)
    # Steps at which an attempt started the state afresh, and why ([{"step", "reason"}], oldest first).
    restarts: list[dict[str, Any]] = field(default_factory=list)


# No annotations on purpose (see parallel.bf16_compress_any_backend_hook).
def powersgd_hook(hook, bucket):
    """`powerSGD_hook.powerSGD_hook` on ``hook.state``, finished before returning when
    ``hook.wait_each_bucket``; the bucket unchanged while ``hook.local_only``."""
    if hook.local_only:
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    fut = powerSGD_hook.powerSGD_hook(hook.state, bucket)
    if hook.wait_each_bucket:
        fut.wait()
    return fut


def state_dict(state: PowerSGDState) -> dict[str, Any]:
    """This rank's PowerSGD state as plain values and CPU tensors (safe for ``weights_only`` loading).

    ``{"format": "trainforge.powersgd/v1", "state": {field: value}}`` with every field of
    ``PowerSGDState.__getstate__``; the three bucket dicts as ``{bucket index: (n,) tensor}``, the
    numpy RandomState as ``{"key": (624,) int64, "pos", "has_gauss", "gauss"}``.
    """
    out: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(state, name)
        if name == "rng":
            _, key, pos, has_gauss, gauss = value.get_state(legacy=True)
            value = {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                     "has_gauss": int(has_gauss), "gauss": float(gauss)}
        elif name in _TENSOR_DICTS:
            value = {int(i): t.detach().to("cpu", copy=True) for i, t in value.items()}
        out[name] = value
    return {"format": STATE_FORMAT, "state": out}


def from_state_dict(like: PowerSGDState, saved: Any, device: torch.device) -> tuple[PowerSGDState | None, str]:
    """A new PowerSGD state from `state_dict`'s output, on ``like``'s process group, tensors on ``device``.

    Returns ``(state, "")``, or ``(None, why)`` when ``saved`` does not fit ``like`` (another
    format, fields of another torch version, other settings); ``like`` is never changed.
    """
    if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        return None, f"format {got!r}, expected {STATE_FORMAT!r}"
    fields = saved.get("state") or {}
    if set(fields) != set(_FIELDS):
        return None, (f"saved with PowerSGDState fields {sorted(fields)}, this torch has {sorted(_FIELDS)}")
    changed = [f"{name} {fields[name]!r} -> {getattr(like, name)!r}" for name in SETTINGS
               if fields[name] != getattr(like, name)]
    if changed:
        return None, "settings changed: " + ", ".join(changed)
    state = PowerSGDState.__new__(PowerSGDState)  # no __init__: it would log a fresh config
    state.process_group = like.process_group
    for name, value in fields.items():
        if name == "rng":
            rng = np.random.RandomState()
            rng.set_state(("MT19937", value["key"].numpy().astype(np.uint32), value["pos"], value["has_gauss"],
                           value["gauss"]))
            value = rng
        elif name in _TENSOR_DICTS:
            value = {int(i): t.to(device) for i, t in value.items()}
        setattr(state, name, value)
    return state, ""


def rebuild_buckets(ddp: torch.nn.Module, hook: PowerSGDHook, tokens: torch.Tensor,
                    autocast: AbstractContextManager) -> None:
    """Make DDP rebuild its buckets now, with no step taken and no PowerSGD state used (module doc).

    One forward and backward pass of ``ddp`` on ``tokens`` ((micro_batch, seq_len) int64; the
    values do not matter, the order gradients arrive in does) with ``hook.local_only`` set; the
    gradients are dropped and the RNG states put back. Every rank must call it (DDP syncs
    buffers in the forward pass).
    """
    params = list(ddp.parameters())
    devices = [tokens.device] if tokens.device.type == "cuda" else []
    hook.local_only = True
    try:
        with torch.random.fork_rng(devices=devices):
            with autocast:
                loss = lm_loss(ddp, tokens, tokens)
            loss.backward()
    finally:
        hook.local_only = False
    for p in params:
        p.grad = None
    log.info("dummy forward and backward pass done (no communication): DDP rebuilds its buckets in the first "
             "step's forward pass, as the uninterrupted run did in its second")
