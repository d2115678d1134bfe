"""What the trainer program does to reach its first step sooner; nothing here changes training.

`import_llama` (called by the trainer, validator and exporter programs only) imports transformers' Llama with the optional
packages that transformers probes for at import time but training never uses (`UNUSED_BY_TRAINING`)
hidden, so transformers does not load them; it must never hide a package the trainer uses. `process_started_at` is the process's
start on the wall clock, to the kernel's tick. Why and what it saves: docs/trainer.md, "Startup".
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

#: Imported by transformers only when installed, and used only off the training path: scikit-learn
#: by assisted generation (``generation/candidate_generator.py``: ``roc_curve``), SciPy by the
#: object-detection losses (``linear_sum_assignment``), torchao by its quantizer registry (loading
#: torchao-quantized checkpoints; the trainer's own fp8 imports torchao itself, trainer/float8.py).
#: scikit-learn brings SciPy and pandas.
UNUSED_BY_TRAINING = ("sklearn", "scipy", "torchao")
#: The module whose import loads transformers' model machinery (generation, masks, auto classes).
LLAMA_MODULE = "transformers.models.llama.modeling_llama"


@contextmanager
def hidden(packages: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """Inside the block, ``packages`` not yet imported look uninstalled: ``importlib.util.find_spec``
    returns None and importing them raises `ModuleNotFoundError` (``None`` in `sys.modules`, the
    import system's own marker). Yields the names hidden; they are importable again after the block.
    """
    names = tuple(p for p in packages if p not in sys.modules)
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield names
    finally:
        for name in names:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def import_llama(unused: tuple[str, ...] = UNUSED_BY_TRAINING, module: str = LLAMA_MODULE) -> None:
    """Import ``module`` with ``unused`` hidden (no-op once it is imported).

    transformers then records them as not installed for the life of the process (its
    ``is_*_available`` checks are cached): only the features named at `UNUSED_BY_TRAINING` notice.
    Should a release of transformers import one of them unconditionally, the import is retried
    with nothing hidden, so this can cost time but never break the trainer.
    """
    if module in sys.modules:
        return
    try:
        with hidden(unused) as names:
            importlib.import_module(module)
    except ImportError as err:
        if (getattr(err, "name", None) or "").split(".")[0] not in unused:
            raise
        log.info("%s needs %s at import: imported again with nothing hidden", module, err.name)
        importlib.import_module(module)
        return
    log.debug("%s imported without %s (unused by training)", module, ", ".join(names) or "nothing")


def process_started_at() -> float:
    """When this process started, seconds since the epoch.

    Linux: its start in clock ticks since boot (``/proc/self/stat``, field 22) against
    ``CLOCK_BOOTTIME`` now. psutil's ``create_time`` adds the same ticks to the boot time that
    ``/proc/stat`` gives in whole seconds, so it reads up to 1 s early. Elsewhere: psutil's.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        since_start_s = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start_s
    except (OSError, AttributeError, IndexError, ValueError):
        import psutil

        return psutil.Process().create_time()
