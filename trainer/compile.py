"""torch.compile in the trainer (job config ``framework.compile``): each decoder layer compiled in
place, and a watch on recompilations.

`compile_layers` calls ``nn.Module.compile`` on every decoder layer, as torchtitan compiles each
transformer block: the module keeps its class and parameter names (no ``_orig_mod.`` wrapper), so
checkpoints, the validator and the exporter see an uncompiled model's state dict. All layers share
one compiled graph (parameters are graph inputs), shapes are static (``dynamic=False``: the
sequence length and micro-batch are fixed), and hooks (DDP, FSDP2, activation checkpointing) stay
around the compiled code. Never imported by the validator or exporter: they run eager.

`RecompileWatch` counts what Dynamo recompiles and logs a warning with Dynamo's own reason for any
recompilation after warm-up (docs/trainer.md, "Compile").
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

log = logging.getLogger(__name__)

#: Steps in which compiling (and recompiling) is expected: the first forward/backward compiles.
WARMUP_STEPS = 2
_RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"


def missing_compiler(device_type: str) -> str | None:
    """What torch.compile lacks on this machine to build its kernels, or None.

    Inductor writes C++ for the CPU (``CXX``, else ``g++``, ``c++`` or ``clang++``) and Triton
    kernels for CUDA, whose launcher Triton builds with a C compiler (``CC``, else ``cc``, ``gcc``
    or ``clang``). A slim container image often has neither.
    """
    if device_type == "cuda":
        variable, names, what = "CC", ("cc", "gcc", "clang"), "a C compiler (Triton builds its kernel launchers)"
    else:
        variable, names, what = "CXX", ("g++", "c++", "clang++"), "a C++ compiler (Inductor builds its CPU kernels)"
    given = os.environ.get(variable)
    if given:
        return None if shutil.which(given) else f"{what}: {variable}={given!r} is not an executable"
    if any(shutil.which(name) for name in names):
        return None
    return f"{what}: none of {', '.join(names)} is on PATH and {variable} is unset"


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer of a causal LM in place (`decoder_layers`); returns how many.

    Call after activation checkpointing is enabled and before DDP/FSDP2 wrap the model.
    """
    from trainforge.trainer.model import decoder_layers

    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=False)
    return len(layers)


class RecompileWatch(logging.Handler):
    """Counts Dynamo recompilations and warns, with the cause, about those after warm-up.

    Dynamo reports a recompilation (and the guard that failed: a new shape, dtype, a changed
    Python value) on its ``recompiles`` log artifact; this handler enables that artifact unless
    ``TORCH_LOGS`` already configures torch's logging, and takes its records. `step` tells it which
    optimizer step is running.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.step = 0
        self.recompiles = 0  # all recompilations, warm-up included
        self.after_warmup = 0
        self._logger = logging.getLogger(_RECOMPILES_LOGGER)

    def __enter__(self) -> RecompileWatch:
        if not os.environ.get("TORCH_LOGS"):
            torch._logging.set_logs(recompiles=True)
        self._logger.setLevel(logging.DEBUG)
        self._logger.propagate = False  # ours alone: no second copy on torch's stderr handler
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.recompiles += 1
        reason = " ".join(record.getMessage().split())  # one line: "Recompiling function forward ... - 0/0: ..."
        if self.step > WARMUP_STEPS:
            self.after_warmup += 1
            log.warning("torch.compile recompiled during step %d (after warm-up; each recompilation stalls the "
                        "GPU): %s", self.step, reason)
        else:
            log.info("torch.compile recompiled during warm-up step %d: %s", self.step, reason)
