"""MLflow's ``system/gpu_*`` metrics for the job's own GPUs only (trainforge.trainer.gpus).

MLflow 3's ``SystemMetricsMonitor`` cannot be told which GPUs to watch: its ``GPUMonitor``
opens every device NVML lists (``range(nvmlDeviceGetCount())``), a neighbour's on a shared
node. :func:`restrict_gpus` swaps it, in the monitor's ``monitors`` list, for
:class:`JobGpuMonitor`, which samples the same figures of the job's devices: utilisation,
memory and power, as ``gpu_<NVML index>_*`` (a MIG instance: ``gpu_<index>_mig_<k>_*``), the
NVML index as nvidia-smi and the ledger's ``energy/source/gpu<index>`` tags name it. A figure
NVML does not report for a device (a MIG instance's power) is left out.
"""

from __future__ import annotations

import logging
from typing import Any

from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor

from trainforge.trainer.gpus import JobGpu, JobGpus

log = logging.getLogger(__name__)


def metric_prefix(gpu: JobGpu) -> str:
    """``gpu_1`` for GPU 1, ``gpu_1_mig_0`` for its MIG instance 0 (MLflow's naming)."""
    return f"gpu_{gpu.index}" + (f"_mig_{gpu.mig}" if gpu.mig is not None else "")


class JobGpuMonitor(BaseMetricsMonitor):
    """MLflow's GPU monitor for the given devices only (module docstring)."""

    def __init__(self, nvml: Any, devices: list[JobGpu]) -> None:
        super().__init__()
        self.nvml, self.devices = nvml, list(devices)
        self._unsupported: set[tuple[str, str]] = set()  # (device, figure) NVML said no to

    def _read(self, gpu: JobGpu, figure: str, fn: Any) -> Any:
        """``fn()``, or None when NVML does not report ``figure`` for ``gpu`` (warned once)."""
        if (gpu.key, figure) in self._unsupported:
            return None
        try:
            return fn()
        except getattr(self.nvml, "NVMLError", Exception) as err:
            self._unsupported.add((gpu.key, figure))
            log.info("system metrics: GPU %s reports no %s (%s): left out", gpu.key, figure, err)
            return None

    def collect_metrics(self) -> None:
        nvml = self.nvml
        for gpu in self.devices:
            name, h = metric_prefix(gpu), gpu.handle
            memory = self._read(gpu, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(h))
            if memory is not None and memory.total:
                self._metrics[f"{name}_memory_usage_percentage"].append(
                    round(memory.used / memory.total * 100, 1))
                self._metrics[f"{name}_memory_usage_megabytes"].append(memory.used / 1e6)
            rates = self._read(gpu, "utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(h))
            if rates is not None:
                self._metrics[f"{name}_utilization_percentage"].append(rates.gpu)
            power = self._read(gpu, "power", lambda: (nvml.nvmlDeviceGetPowerUsage(h),
                                                      nvml.nvmlDeviceGetEnforcedPowerLimit(h)))
            if power is not None:
                milliwatts, limit = power
                self._metrics[f"{name}_power_usage_watts"].append(milliwatts / 1000)
                if limit:
                    self._metrics[f"{name}_power_usage_percentage"].append(milliwatts / limit * 100)

    def aggregate_metrics(self) -> dict[str, float]:
        return {k: round(sum(v) / len(v), 1) for k, v in self._metrics.items() if v}


def restrict_gpus(monitor: Any, gpus: JobGpus) -> None:
    """Make ``monitor`` (an MLflow ``SystemMetricsMonitor``) watch the job's GPUs only: its
    NVIDIA GPU monitor is dropped (it watches the whole node) and, when the job has identified
    devices, :class:`JobGpuMonitor` takes their place. An AMD GPU monitor (no NVML) is left as it is."""
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

    monitor.monitors = [m for m in monitor.monitors if not isinstance(m, GPUMonitor)]
    if gpus.identified:  # an unidentified device is no GPU NVML could be asked about
        monitor.monitors.append(JobGpuMonitor(gpus.nvml, gpus.identified))
