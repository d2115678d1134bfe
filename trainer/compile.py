"""torch.compile in the trainer (job config ``framework.compile``): each decoder layer compiled in
place, and a watch on recompilations.

`compile_layers` calls ``nn.Module.compile`` on every decoder layer, as torchtitan compiles each
transformer block: the module keeps its class and parameter names (no ``_orig_mod.`` wrapper), so
checkpoints, the validator and the exporter see an uncompiled model's state dict. All layers share
one compiled graph (parameters are graph inputs), shapes are static (``dynamic=False``: the
sequence length and micro-batch are fixed), and hooks (DDP, FSDP2, activation checkpointing) stay
around the compiled code. Never imported by the validator or exporter: they run eager.

`RecompileWatch` accounts for compiling while the steps run: the seconds spent compiling (the
ledger's ``compile`` bucket), the graphs and recompilations (``compile/*`` metrics), a warning
with Dynamo's reason for each new kind of recompilation after warm-up, and Dynamo's recompile
or cache-size limit, which ``framework.compile_fallback`` makes an error or a partly eager run
(docs/trainer.md, "Compile").
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time

import torch

from trainforge.contract import COMPILE_MODE_TAG
from trainforge.trainer.errors import ConfigError

log = logging.getLogger(__name__)

#: Steps in which compiling (and recompiling) is expected: the first forward/backward compiles.
WARMUP_STEPS = 2
_RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
_LIMIT_LOGGER = "torch._dynamo.convert_frame"  # "torch._dynamo hit config.recompile_limit (8) ..."
_LIMIT_MESSAGE = "torch._dynamo hit config."


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


class CompileLimitError(ConfigError):
    """Dynamo's recompile or cache-size limit was hit with ``framework.compile_fallback: error``:
    exit 78, permanent (the same shapes and code hit it again on a retry)."""


class RecompileWatch(logging.Handler):
    """Accounts for torch.compile while the steps run; see the module docstring.

    Dynamo reports a recompilation (and the guard that failed: a new shape, dtype, a changed
    Python value) on its ``recompiles`` log artifact; this handler enables that artifact unless
    ``TORCH_LOGS`` already configures torch's logging, and takes its records. Compile time is
    measured between Dynamo's compile-start and compile-end callbacks (a frame's compile, and a
    backward compiled lazily at its first run). `begin_step` tells it which optimizer step runs.
    """

    def __init__(self, fallback: str = "error") -> None:
        super().__init__(logging.DEBUG)
        self.fallback = fallback  # framework.compile_fallback: "error" | "warn"
        self.step = 0
        self.recompiles = 0  # all recompilations, warm-up included
        self.after_warmup = 0
        self.seconds = 0.0  # compiling on this rank, since __enter__
        self.limit_hits: list[str] = []  # what hit a limit, as `_limit_text` words it
        self._reasons: set[str] = set()  # kinds of recompilation already warned about
        self._taken = 0.0  # of `seconds`, what `take_seconds` handed out
        self._since: float | None = None
        self._graphs_before = 0
        self._logger = logging.getLogger(_RECOMPILES_LOGGER)
        self._limits = _LimitHandler(self)
        self._fail_on_limit = torch._dynamo.config.patch(fail_on_recompile_limit_hit=fallback == "error")

    def __enter__(self) -> RecompileWatch:
        from torch._dynamo.callback import callback_handler

        if not os.environ.get("TORCH_LOGS"):
            torch._logging.set_logs(recompiles=True)
        self._logger.setLevel(logging.DEBUG)
        self._logger.propagate = False  # ours alone: no second copy on torch's stderr handler
        self._logger.addHandler(self)
        logging.getLogger(_LIMIT_LOGGER).addHandler(self._limits)
        callback_handler.register_start_callback(self._compile_started)
        callback_handler.register_end_callback(self._compile_ended)
        self._graphs_before = _unique_graphs()
        self._fail_on_limit.__enter__()  # "error": Dynamo raises instead of running the frame eagerly
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.exc import FailOnRecompileLimitHit

        self._fail_on_limit.__exit__(None, None, None)
        callback_handler.remove_start_callback(self._compile_started)
        callback_handler.remove_end_callback(self._compile_ended)
        logging.getLogger(_LIMIT_LOGGER).removeHandler(self._limits)
        self._logger.removeHandler(self)
        cause, seen = exc, 0
        while cause is not None and seen < 8:  # Dynamo's own, or a wrapper's around it (autograd, hooks)
            if isinstance(cause, FailOnRecompileLimitHit):
                raise CompileLimitError(self._limit_error()) from exc
            cause, seen = cause.__cause__ or cause.__context__, seen + 1

    def begin_step(self, step: int) -> None:
        """Optimizer step ``step`` starts. Raises `CompileLimitError` when a limit was hit
        under ``error`` and Dynamo went on anyway."""
        if self.limit_hits and self.fallback == "error":
            raise CompileLimitError(self._limit_error())
        self.step = step

    @property
    def graphs(self) -> int:
        """Graphs Dynamo compiled since __enter__ (a layer's forward; recompilations add one each)."""
        return _unique_graphs() - self._graphs_before

    @property
    def mode(self) -> str:
        """``compiled``, or ``partly_eager`` once a limit left a function to run eagerly."""
        return "partly_eager" if self.limit_hits else "compiled"

    def take_seconds(self) -> float:
        """Compile seconds since the last call (the ledger's ``compile`` bucket of a step)."""
        taken, self._taken = self.seconds - self._taken, self.seconds
        return taken

    def metrics(self) -> dict[str, float]:
        """The MLflow metrics of compiling so far in this attempt."""
        return {"compile/seconds": self.seconds, "compile/graphs": float(self.graphs),
                "compile/recompiles": float(self.recompiles)}

    def tags(self) -> dict[str, str]:
        """The MLflow tag saying how the steps (and so the throughput figures) ran."""
        return {COMPILE_MODE_TAG: self.mode}

    def summary(self) -> str:
        """The run's last words on compiling."""
        eager = f"; partly eager: {self.limit_hits[0]}" if self.limit_hits else ""
        return (f"torch.compile: {self.seconds:.1f}s compiling, {self.graphs} graph(s), {self.recompiles} "
                f"recompilation(s), {self.after_warmup} after warm-up{eager}")

    def _compile_started(self, args: object) -> None:
        self._since = time.perf_counter()

    def _compile_ended(self, args: object) -> None:
        if self._since is not None:
            self.seconds += time.perf_counter() - self._since
        self._since = None

    def emit(self, record: logging.LogRecord) -> None:
        self.recompiles += 1
        reason = " ".join(record.getMessage().split())  # one line: "Recompiling function forward ... - 0/0: ..."
        if self.step <= WARMUP_STEPS:
            log.info("torch.compile recompiled during warm-up step %d: %s", self.step, reason)
            return
        self.after_warmup += 1
        kind = _reason_kind(reason)
        if kind not in self._reasons:
            self._reasons.add(kind)
            log.warning("torch.compile recompiled during step %d (after warm-up; each recompilation stalls the "
                        "GPU; further ones for this reason are only counted): %s", self.step, reason)

    def _limit_hit(self, record: logging.LogRecord) -> None:
        what = _limit_text(record)
        self.limit_hits.append(what)
        if self.fallback == "warn" and len(self.limit_hits) == 1:
            log.warning("during step %d torch.compile hit %s: Dynamo runs that function eagerly from now on; this run "
                        "is partly eager (tag %s=partly_eager, its ledger record), its throughput not the compiled "
                        "model's (framework.compile_fallback=warn)", self.step, what, COMPILE_MODE_TAG)

    def _limit_error(self) -> str:
        what = self.limit_hits[0] if self.limit_hits else "Dynamo's recompile limit"
        return (f"during step {self.step} torch.compile hit {what}: Dynamo would run that function eagerly from "
                "then on, and the run would report eager steps as compiled. Keep its inputs' shapes and Python "
                "values fixed (the reason names the guard that failed), or set "
                "training.framework.compile_fallback: warn to train on partly eager, or "
                "training.framework.compile: false")


class _LimitHandler(logging.Handler):
    """Takes Dynamo's warning that a function hit a recompile or cache-size limit."""

    def __init__(self, watch: RecompileWatch) -> None:
        super().__init__(logging.WARNING)
        self.watch = watch

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith(_LIMIT_MESSAGE):
            self.watch._limit_hit(record)


def _limit_text(record: logging.LogRecord) -> str:
    """``torch._dynamo.config.recompile_limit (8) compiling 'forward' (file:line), the last
    reason: ...`` from Dynamo's warning (its arguments: limit, value, function, reason)."""
    args = record.args if isinstance(record.args, tuple) else ()
    if len(args) >= 4:
        limit, value, function, reason = args[:4]
        last = f", the last reason: {reason}" if reason else ""
        return f"torch._dynamo.config.{limit} ({value}) compiling {function}{last}"
    return " ".join(record.getMessage().split()[:12])


def _reason_kind(reason: str) -> str:
    """The function and its newest guard failure, numbers left out: the same guard failing again
    for another size is the same kind ("... - 0/1: tensor 'x' size mismatch at index 0. expected
    3, actual 4 - 0/0: ..." and "... - 0/2: ... expected 4, actual 5 - ...")."""
    function = reason.partition(" triggered by ")[0]
    newest = re.search(r"- \d+/\d+: (.*?)(?: - \d+/\d+: |$)", reason)
    return re.sub(r"\d+", "N", f"{function}: {newest.group(1) if newest else reason}")


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
