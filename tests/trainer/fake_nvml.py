"""A fake ``pynvml`` module: a machine of GPUs, MIG instances and NVML answers, no GPU needed.

    nvml = fake_nvml([FakeGpu(power_w=250.0, energy_mj=None), ...])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

Each function answers as nvidia-ml-py's does (the same names, errors as ``NVMLError``
subclasses); a figure set to None raises ``NVMLError_NotSupported``. ``nvml.touched`` records
which device every energy, power, memory or utilisation call read, so a test can tell which
GPUs were metered.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

NOT_SUPPORTED, INVALID_ARGUMENT, NOT_FOUND = 3, 2, 6


class NVMLError(Exception):
    """nvidia-ml-py's base error: ``value`` is the NVML return code."""

    _TEXT = {NOT_SUPPORTED: "Not Supported", INVALID_ARGUMENT: "Invalid Argument",
             NOT_FOUND: "Not Found"}

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._TEXT.get(self.value, f"NVML Error with code {self.value}")


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - nvidia-ml-py's name
    def __init__(self) -> None:
        super().__init__(NOT_SUPPORTED)


@dataclass
class FakeGpu:
    """One GPU: its identity and what NVML reads of it (None: not supported)."""

    uuid: str = ""
    name: str = "NVIDIA H100 80GB HBM3"
    power_w: float | None = 300.0
    energy_mj: int | None = 1_000_000
    migs: list[str] | None = None
    """UUIDs of its MIG instances when it is in MIG mode (None: MIG off)."""
    memory_used: int = 10 * 2**30
    utilization: int = 50


@dataclass(frozen=True)
class Handle:
    index: int
    mig: int | None = None


@dataclass
class _State:
    gpus: list[FakeGpu]
    touched: list[tuple[str, str]] = field(default_factory=list)


def fake_nvml(gpus: list[FakeGpu]) -> types.ModuleType:
    """A module object that stands in for ``pynvml`` on a machine of ``gpus``."""
    for i, gpu in enumerate(gpus):
        gpu.uuid = gpu.uuid or f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"
    state = _State(gpus)
    mod = types.ModuleType("pynvml")
    mod.NVMLError, mod.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    mod.touched = state.touched

    def gpu_of(h: Handle) -> FakeGpu:
        return state.gpus[h.index]

    def key(h: Handle) -> str:
        return f"gpu{h.index}" + (f"-mig{h.mig}" if h.mig is not None else "")

    def supported(value, h: Handle, what: str):
        state.touched.append((key(h), what))
        if value is None or (h.mig is not None and what in ("energy", "power")):
            raise NVMLError_NotSupported()  # NVML reads neither on a MIG instance
        return value

    def handle_by_index(i: int) -> Handle:
        if not 0 <= i < len(state.gpus):
            raise NVMLError(INVALID_ARGUMENT)
        return Handle(i)

    def uuid(h: Handle) -> str:
        return gpu_of(h).uuid if h.mig is None else gpu_of(h).migs[h.mig]

    def mig_mode(h: Handle) -> list[int]:
        if h.mig is not None:
            raise NVMLError_NotSupported()
        return [1, 1] if gpu_of(h).migs is not None else [0, 0]

    def mig_handle(h: Handle, k: int) -> Handle:
        if k >= len(gpu_of(h).migs or []):
            raise NVMLError(NOT_FOUND)
        return Handle(h.index, k)

    def handle_by_uuid(wanted: str) -> Handle:
        for i, gpu in enumerate(state.gpus):
            if gpu.uuid == wanted:
                return Handle(i)
        raise NVMLError(NOT_FOUND)

    mod.nvmlInit = lambda: None
    mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetCount = lambda: len(state.gpus)
    mod.nvmlDeviceGetHandleByIndex = handle_by_index
    mod.nvmlDeviceGetHandleByUUID = handle_by_uuid
    mod.nvmlDeviceGetUUID = uuid
    mod.nvmlDeviceGetName = lambda h: gpu_of(h).name
    mod.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{0x18 + h.index:02X}:00.0")
    mod.nvmlDeviceGetMigMode = mig_mode
    mod.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    mod.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    mod.nvmlDeviceGetGpuInstanceId = lambda h: 10 + h.mig
    mod.nvmlDeviceGetComputeInstanceId = lambda h: 0
    mod.nvmlDeviceGetTotalEnergyConsumption = lambda h: supported(gpu_of(h).energy_mj, h, "energy")
    mod.nvmlDeviceGetPowerUsage = lambda h: int(supported(gpu_of(h).power_w, h, "power") * 1000)
    mod.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=supported(gpu_of(h).memory_used, h, "memory"), total=80 * 2**30)
    mod.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(
        gpu=supported(gpu_of(h).utilization, h, "utilization"), memory=0)
    return mod
