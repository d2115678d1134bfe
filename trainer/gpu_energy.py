"""Energy of the job's own GPUs (trainforge.trainer.gpus), per device, from what NVML can read.

For each device, the first that works when metering starts:

1. ``measured-nvml``: the total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``,
   millijoules since the driver loaded; Volta and newer, not on MIG instances or most vGPUs);
2. ``power_integration``: the power readings (``nvmlDeviceGetPowerUsage``, milliwatts) sampled
   by a background thread at `POWER_HZ` and integrated by the trapezoid rule (and once more at
   every read, so the figure runs up to the read);
3. ``unknown``, with the reason (what NVML answered, or why the rank's device could not be
   identified): never 0. The orchestrator does not
   estimate such a device from the spec's per-GPU power: it is typically a MIG instance or a
   vGPU, a share of a board whose power is not that figure (trainforge.ledger.energy).

A device whose reading fails later becomes ``unknown`` from then on: what it read before is
not the whole attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from trainforge.trainer.gpus import JobGpu

log = logging.getLogger(__name__)

NVML = "measured-nvml"
POWER = "power_integration"
UNKNOWN = "unknown"
MIXED = "mixed"
"""The ``gpu`` kind's source when its devices' sources differ (each device says its own)."""
POWER_HZ = 4.0
"""Power samples per second per device on ``power_integration``."""


@dataclass
class GpuReading:
    """One device's meter: its source, the counter's start or the power integral so far."""

    gpu: JobGpu
    source: str
    start_mj: int | None = None
    joules: float = 0.0
    last: tuple[float, float] | None = None
    """(monotonic time, watts) of the newest power sample."""
    reason: str | None = None

    def entry(self) -> dict[str, Any]:
        """The device's part of the attempt record (docs/contracts.md, "Run ledger")."""
        out: dict[str, Any] = {}
        if self.gpu.uuid is not None:
            out["uuid"] = self.gpu.uuid
        if self.gpu.parent_uuid is not None:
            out["parent_uuid"] = self.gpu.parent_uuid
        if self.gpu.pci_bus_id:
            out["pci_bus_id"] = self.gpu.pci_bus_id
        if self.gpu.local_rank is not None:
            out["local_rank"] = self.gpu.local_rank
        out["source"] = self.source
        if self.source == UNKNOWN:
            out["reason"] = self.reason or "unknown"
        else:
            out["energy_j"] = round(self.joules, 3)
        return out


def _start(nvml: Any, gpu: JobGpu) -> GpuReading:
    """A device's meter, from the first source NVML answers for it (module docstring)."""
    if gpu.handle is None:  # not identified (trainforge.trainer.gpus): never a guessed GPU's
        return GpuReading(gpu, UNKNOWN, reason=f"not identified: {gpu.reason}")
    error = getattr(nvml, "NVMLError", Exception)
    try:
        return GpuReading(gpu, NVML, start_mj=int(nvml.nvmlDeviceGetTotalEnergyConsumption(gpu.handle)))
    except error as err:
        counter_err = err
    try:
        watts = nvml.nvmlDeviceGetPowerUsage(gpu.handle) / 1000.0
    except error as err:
        return GpuReading(gpu, UNKNOWN, reason=f"NVML reads neither its total-energy counter "
                          f"({counter_err}) nor its power ({err})")
    return GpuReading(gpu, POWER, last=(time.monotonic(), watts))


class GpuMeter:
    """The job's devices metered since :meth:`open`; power sampled on a daemon thread."""

    def __init__(self, nvml: Any, readings: list[GpuReading], hz: float = POWER_HZ) -> None:
        self.nvml, self.readings, self.hz = nvml, readings, hz
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if any(r.source == POWER for r in readings):
            self._thread = threading.Thread(target=self._run, name="gpu-power-sampler", daemon=True)
            self._thread.start()

    @classmethod
    def open(cls, nvml: Any, gpus: list[JobGpu], hz: float = POWER_HZ) -> GpuMeter:
        """Start metering ``gpus`` (an initialised ``nvml``); ``hz``: power samples per second."""
        if not hz > 0:
            raise ValueError(f"power sampling rate {hz!r} Hz: expected a positive number")
        readings = [_start(nvml, g) for g in gpus]
        for r in readings:
            if r.source != NVML:
                log.info("GPU %s (%s): energy %s%s", r.gpu.key, r.gpu.uuid,
                         "from integrated power readings" if r.source == POWER else "unknown",
                         f": {r.reason}" if r.reason else "")
        return cls(nvml, readings, hz)

    def _run(self) -> None:
        while not self._stop.wait(1.0 / self.hz):
            self.sample()

    def sample(self) -> None:
        """Add one power sample of each ``power_integration`` device to its integral."""
        error = getattr(self.nvml, "NVMLError", Exception)
        with self._lock:
            for r in self.readings:
                if r.source != POWER or r.last is None:
                    continue
                try:
                    watts = self.nvml.nvmlDeviceGetPowerUsage(r.gpu.handle) / 1000.0
                except error as err:
                    self._lost(r, f"its power reading failed after {r.joules:.0f} J ({err})")
                    continue
                now = time.monotonic()
                t0, w0 = r.last
                r.joules += (w0 + watts) / 2.0 * max(0.0, now - t0)
                r.last = (now, watts)

    def _lost(self, r: GpuReading, why: str) -> None:
        log.warning("GPU %s (%s): energy unknown from now on: %s", r.gpu.key, r.gpu.uuid, why)
        r.source, r.reason, r.last = UNKNOWN, why, None

    def read(self) -> list[GpuReading]:
        """Every device's reading as of now (counters read, power sampled once more)."""
        error = getattr(self.nvml, "NVMLError", Exception)
        self.sample()
        with self._lock:
            for r in self.readings:
                if r.source != NVML:
                    continue
                try:
                    now = int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(r.gpu.handle))
                except error as err:
                    self._lost(r, f"its energy counter failed ({err})")
                    continue
                r.joules = (now - int(r.start_mj or 0)) / 1000.0
            return list(self.readings)

    def close(self) -> None:
        """Stop the sampling thread (the integrals keep what they hold)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


def kind_source(readings: list[GpuReading]) -> str | None:
    """The ``gpu`` kind's source: its devices' one source, `MIXED`, or None without devices."""
    sources = {r.source for r in readings}
    if not sources:
        return None
    return sources.pop() if len(sources) == 1 else MIXED
