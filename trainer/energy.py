"""Measured energy of rank 0's machine: NVML's total-energy counter per GPU, RAPL per CPU package.

    meter = EnergyMeter.open(gpus=[0, 1])   # the machine's counters that can be read
    ...
    meter.joules()   # {"gpu": J, "cpu": J} since open(), for the kinds that are measured
    meter.sources    # {"gpu": "measured-nvml", "cpu": "measured-rapl"}

NVML (``pynvml``, from nvidia-ml-py): ``nvmlDeviceGetTotalEnergyConsumption``, millijoules
since the driver loaded, on Volta and newer. RAPL: the top-level zones under
``/sys/class/powercap`` (``intel-rapl:N``, one per CPU package; ``amd-rapl`` likewise),
``energy_uj`` in microjoules, wrapping at ``max_energy_range_uj``; the files are often readable
by root only, and then the CPU is not measured. A kind that is not measured is left out: the
orchestrator estimates it from the spec's power figures (trainforge.ledger.energy).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POWERCAP_ROOT = Path("/sys/class/powercap")
NVML = "measured-nvml"
RAPL = "measured-rapl"
PACKAGE_ZONE = re.compile(r"^[a-z-]*rapl:\d+$")


@dataclass
class RaplZone:
    """One package zone: its counter file, wrap range and the last reading (µJ)."""

    path: Path
    max_uj: int
    last_uj: int
    total_uj: int = 0

    def advance(self) -> None:
        now = int(self.path.read_text())
        delta = now - self.last_uj
        self.total_uj += delta if delta >= 0 else delta + self.max_uj  # one wrap between reads
        self.last_uj = now


def rapl_zones(root: Path = POWERCAP_ROOT) -> list[RaplZone]:
    """The readable top-level RAPL package zones under ``root`` (none when unreadable)."""
    zones = []
    if not root.is_dir():
        return zones
    for zone in sorted(root.iterdir()):
        if not PACKAGE_ZONE.match(zone.name):
            continue  # intel-rapl:0 is a package; intel-rapl:0:1 is a sub-zone of it
        try:
            now = int((zone / "energy_uj").read_text())
            max_uj = int((zone / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            continue  # root-only since Linux 5.10 on most distributions
        zones.append(RaplZone(zone / "energy_uj", max_uj, now))
    return zones


def _nvml_handles(gpus: list[int]) -> tuple[Any, list[Any], list[int]] | None:
    """``(pynvml, device handles, start readings in mJ)``, or None without NVML."""
    try:
        import pynvml  # GPU-only path: nvidia-ml-py is installed with the GPU image
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpus]
        start = [int(pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in handles]
    except Exception as err:  # NVMLError: no driver, or a GPU older than Volta
        log.info("NVML energy counters unavailable (%s): GPU energy is estimated", err)
        return None
    return pynvml, handles, start


@dataclass
class EnergyMeter:
    """The counters of one machine read since :meth:`open`; kinds that cannot be read are absent."""

    rapl: list[RaplZone] = field(default_factory=list)
    nvml: tuple[Any, list[Any], list[int]] | None = None

    @classmethod
    def open(cls, gpus: list[int], powercap_root: Path = POWERCAP_ROOT) -> EnergyMeter:
        """Start reading the machine's RAPL zones and the NVML counters of ``gpus`` (indices)."""
        return cls(rapl_zones(powercap_root), _nvml_handles(gpus) if gpus else None)

    @property
    def sources(self) -> dict[str, str]:
        """``{device kind: source}`` of each measured kind (``gpu``, ``cpu``)."""
        found = {}
        if self.nvml is not None:
            found["gpu"] = NVML
        if self.rapl:
            found["cpu"] = RAPL
        return found

    def joules(self) -> dict[str, float]:
        """Energy per measured kind since :meth:`open`, joules; a kind whose read fails is dropped."""
        out: dict[str, float] = {}
        if self.nvml is not None:
            pynvml, handles, start = self.nvml
            try:
                now = [int(pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in handles]
                out["gpu"] = sum(n - s for n, s in zip(now, start)) / 1000.0
            except Exception as err:  # noqa: BLE001 - a reading is worth less than training
                log.warning("NVML energy read failed (%s): GPU energy is estimated from now on", err)
                self.nvml = None
        if self.rapl:
            try:
                for zone in self.rapl:
                    zone.advance()
                out["cpu"] = sum(z.total_uj for z in self.rapl) / 1e6
            except (OSError, ValueError) as err:
                log.warning("RAPL energy read failed (%s): CPU energy is estimated from now on", err)
                self.rapl = []
        return out
