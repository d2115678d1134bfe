"""Measured energy of rank 0's machine: the job's own GPUs through NVML, RAPL per CPU package.

    meter = EnergyMeter.open(JobGpus.open())   # the job's GPUs (trainforge.trainer.gpus)
    ...
    meter.joules()    # {"gpu": J, "cpu": J} since open(), for the kinds read
    meter.sources     # {"gpu": "measured-nvml", "cpu": "measured-rapl"}
    meter.record()    # the attempt record's energy fields, per GPU device

GPUs: per device, the total-energy counter, else integrated power readings, else unknown
(trainforge.trainer.gpu_energy). RAPL: the top-level zones under ``/sys/class/powercap``
(``intel-rapl:N``, one per CPU package; ``amd-rapl`` likewise), ``energy_uj`` in microjoules,
wrapping at ``max_energy_range_uj``; the files are often readable by root only, and then the CPU
is not measured. A kind that is not read at all is left out, with the reason in
``energy_unread``: the orchestrator estimates it from the spec's power figures
(trainforge.ledger.energy).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.trainer.gpu_energy import POWER_HZ, GpuMeter, kind_source
from trainforge.trainer.gpus import JobGpus

log = logging.getLogger(__name__)

POWERCAP_ROOT = Path("/sys/class/powercap")
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


@dataclass
class EnergyMeter:
    """The counters of one machine read since :meth:`open`; kinds that cannot be read are absent
    from :attr:`sources` and :meth:`joules`, and say why in :attr:`unread`."""

    rapl: list[RaplZone] = field(default_factory=list)
    gpu: GpuMeter | None = None
    unread: dict[str, str] = field(default_factory=dict)
    """Kind -> why it is not read (``gpu`` only for a GPU job)."""

    @classmethod
    def open(cls, gpus: JobGpus | None = None, powercap_root: Path = POWERCAP_ROOT,
             power_hz: float = POWER_HZ) -> EnergyMeter:
        """Start reading the machine's RAPL zones and the job's GPUs (None: a CPU job)."""
        zones = rapl_zones(powercap_root)
        unread = {} if zones else {"cpu": f"no readable RAPL package zone under {powercap_root} "
                                          "(often readable by root only)"}
        meter = None
        if gpus is not None and gpus.devices:
            meter = GpuMeter.open(gpus.nvml, gpus.devices, power_hz)
        elif gpus is not None and gpus.unread:
            unread["gpu"] = gpus.unread
        return cls(zones, meter, unread)

    @property
    def sources(self) -> dict[str, str]:
        """``{device kind: source}`` of each kind read (``gpu``: its devices' one source, or
        ``mixed``; absent when every device is unknown)."""
        found = {}
        if self.gpu is not None:
            source = kind_source([r for r in self.gpu.readings if r.source != "unknown"])
            if source:
                found["gpu"] = source
        if self.rapl:
            found["cpu"] = RAPL
        return found

    def joules(self) -> dict[str, float]:
        """Energy per kind read since :meth:`open`, joules (``gpu``: its devices read, summed)."""
        out: dict[str, float] = {}
        if self.gpu is not None:
            read = [r for r in self.gpu.read() if r.source != "unknown"]
            if read:
                out["gpu"] = sum(r.joules for r in read)
        if self.rapl:
            try:
                for zone in self.rapl:
                    zone.advance()
                out["cpu"] = sum(z.total_uj for z in self.rapl) / 1e6
            except (OSError, ValueError) as err:
                log.warning("RAPL energy read failed (%s): CPU energy is estimated from now on", err)
                self.rapl = []
                self.unread["cpu"] = f"the RAPL counters failed ({err})"
        return out

    def record(self) -> dict[str, Any]:
        """The attempt record's energy fields as of now (docs/contracts.md, "Run ledger"):
        ``energy_j`` and ``energy_source`` per kind read, ``gpus`` per device, ``energy_unread``
        per kind not read."""
        out: dict[str, Any] = {}
        joules = self.joules()
        if joules:
            out["energy_j"] = {k: round(v, 3) for k, v in joules.items()}
            out["energy_source"] = self.sources
        if self.gpu is not None:
            out["gpus"] = {r.gpu.key: r.entry() for r in self.gpu.readings}
        if self.unread:
            out["energy_unread"] = dict(self.unread)
        return out

    def close(self) -> None:
        """Stop sampling GPU power (a daemon thread: it would also end with the process)."""
        if self.gpu is not None:
            self.gpu.close()
