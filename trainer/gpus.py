"""The job's own GPUs on this machine, as NVML handles: what the energy meter and the
system-metrics monitor read, and nothing else on a shared node.

    gpus = JobGpus.open()   # CUDA_VISIBLE_DEVICES, LOCAL_WORLD_SIZE and NVML (pynvml)
    gpus.devices            # [JobGpu(key="gpu1", ...), JobGpu(key="gpu3", ...)]
    gpus.unread             # why none could be opened ("pynvml is not installed"), else None

Which devices: the ones ``CUDA_VISIBLE_DEVICES`` lets this process use, in its order, of which
the node's ranks use the first ``LOCAL_WORLD_SIZE`` (local rank *r* trains on ``cuda:r``).
Unset, every device of the machine is visible. Entries, as CUDA reads them:

* an index (``1``): the NVML device of that index. NVML numbers devices in PCI bus order, as
  CUDA does with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on a node of one GPU model (CUDA's default
  order, fastest first, differs only between different models: a warning says so);
* ``GPU-<uuid>``: the GPU of that UUID, or of the one UUID that starts so (CUDA takes a prefix);
* ``MIG-<uuid>``, or the older ``MIG-GPU-<uuid>/<gpu instance>/<compute instance>``: that MIG
  instance;
* a negative index ends the list (CUDA ignores what follows; ``-1`` alone hides every device).

A GPU in MIG mode is never metered as a whole board (its other instances are a neighbour's):
an index or UUID naming one stands for its MIG instances. NVML reads neither energy nor
power of a MIG instance, so its energy is unknown (trainforge.trainer.energy).

Each device's ledger name (``key``) is ``gpu<NVML index>``, a MIG instance's
``gpu<parent index>-mig<instance index>``, as in nvidia-smi.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
_INDEX = re.compile(r"^[+-]?\d+$")
_LEGACY_MIG = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)$")


class DeviceMapError(ValueError):
    """``CUDA_VISIBLE_DEVICES`` names a device this machine's NVML does not have, or twice."""


@dataclass(frozen=True)
class JobGpu:
    """One device of the job on this machine: its ledger name, NVML handle and identity."""

    key: str
    handle: Any = field(compare=False, repr=False)
    uuid: str
    index: int
    """NVML index of the GPU (of the parent GPU for a MIG instance)."""
    mig: int | None = None
    """The MIG instance's index on its parent GPU; None for a whole GPU."""
    pci_bus_id: str | None = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_error(nvml: Any) -> type[BaseException]:
    return getattr(nvml, "NVMLError", Exception)


@dataclass
class _Gpu:
    """A whole GPU as NVML lists it, with its MIG instances when it is in MIG mode."""

    index: int
    handle: Any
    uuid: str
    pci_bus_id: str | None
    name: str
    migs: list[JobGpu] | None  # None: not in MIG mode


def _node_gpus(nvml: Any) -> list[_Gpu]:
    """Every GPU NVML lists on this machine, in NVML (PCI bus) order."""
    error = _nvml_error(nvml)
    gpus = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        try:
            bus = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        except error:
            bus = None
        try:
            name = _text(nvml.nvmlDeviceGetName(handle))
        except error:
            name = ""
        gpus.append(_Gpu(i, handle, _text(nvml.nvmlDeviceGetUUID(handle)), bus, name,
                         _mig_instances(nvml, i, handle, bus)))
    return gpus


def _mig_instances(nvml: Any, index: int, handle: Any, bus: str | None) -> list[JobGpu] | None:
    """The MIG instances NVML lets this process see on a GPU in MIG mode; None otherwise."""
    error = _nvml_error(nvml)
    try:
        current = nvml.nvmlDeviceGetMigMode(handle)[0]
    except (error, AttributeError):
        return None  # not supported: a GPU without MIG, or an NVML from before it
    if not current:
        return None
    found = []
    for k in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, k)
        except error:
            continue  # no instance there, or another container's
        found.append(JobGpu(f"gpu{index}-mig{k}", mig, _text(nvml.nvmlDeviceGetUUID(mig)), index, k,
                            bus))
    return found


def parse_visible(value: str | None) -> list[str] | None:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value; None when unset (every device visible).

    Raises:
        DeviceMapError: an entry that is neither an index nor a ``GPU-``/``MIG-`` UUID.
    """
    if value is None:
        return None
    if not value.strip():
        return []  # CUDA_VISIBLE_DEVICES="": no device
    entries = []
    for raw in value.split(","):
        entry = raw.strip()
        if _INDEX.match(entry):
            if int(entry) < 0:
                break  # CUDA stops at a negative index
            entries.append(str(int(entry)))
        elif entry.startswith(("GPU-", "MIG-")) and len(entry) > 4:
            entries.append(entry)
        else:
            raise DeviceMapError(f"{VISIBLE_ENV}={value!r}: entry {entry!r} is neither a device "
                                 "index (0, 1, ...) nor a GPU-<uuid> or MIG-<uuid>")
    return entries


def _whole(gpu: _Gpu) -> list[JobGpu]:
    if gpu.migs is not None:
        return list(gpu.migs)  # never the whole board of a GPU in MIG mode
    return [JobGpu(f"gpu{gpu.index}", gpu.handle, gpu.uuid, gpu.index, None, gpu.pci_bus_id)]


def _lookup(nvml: Any, entry: str, gpus: list[_Gpu], value: str) -> list[JobGpu]:
    """The device(s) one ``CUDA_VISIBLE_DEVICES`` entry names (module docstring)."""
    where = f"{VISIBLE_ENV}={value!r}: entry {entry!r}"
    if entry.isdigit():
        index = int(entry)
        if index >= len(gpus):
            raise DeviceMapError(f"{where}: this machine's NVML lists {len(gpus)} GPU(s), "
                                 f"indices 0..{len(gpus) - 1}")
        return _whole(gpus[index])
    legacy = _LEGACY_MIG.match(entry)
    if legacy:  # MIG-GPU-<uuid>/<gi>/<ci>: the parent's UUID, then the instance's ids
        parents = [g for g in gpus if g.uuid.lower() == legacy[1].lower()]
        if not parents or parents[0].migs is None:
            raise DeviceMapError(f"{where}: no GPU of UUID {legacy[1]} in MIG mode on this machine")
        gi, ci = int(legacy[2]), int(legacy[3])
        found = [m for m in parents[0].migs if (nvml.nvmlDeviceGetGpuInstanceId(m.handle),
                                                nvml.nvmlDeviceGetComputeInstanceId(m.handle)) == (gi, ci)]
        if not found:
            raise DeviceMapError(f"{where}: GPU {legacy[1]} has no MIG instance of GPU instance "
                                 f"{gi} and compute instance {ci} (nvidia-smi -L lists them)")
        return found[:1]
    wanted = entry.lower()
    if entry.startswith("MIG-"):
        found = [m for g in gpus for m in (g.migs or []) if m.uuid.lower().startswith(wanted)]
    else:
        found = [g for g in gpus if g.uuid.lower().startswith(wanted)]
    if len(found) != 1:
        kind = "MIG instance" if entry.startswith("MIG-") else "GPU"
        raise DeviceMapError(f"{where}: {'no' if not found else len(found)} {kind}(s) of this "
                             "machine have a UUID starting so (nvidia-smi -L lists them)")
    hit = found[0]
    return [hit] if isinstance(hit, JobGpu) else _whole(hit)


def job_gpus(nvml: Any, env: Mapping[str, str] | None = None) -> list[JobGpu]:
    """The job's devices on this machine (module docstring), from an initialised ``nvml``.

    Raises:
        DeviceMapError: ``CUDA_VISIBLE_DEVICES`` names an unknown device, or one twice.
    """
    env = os.environ if env is None else env
    value = env.get(VISIBLE_ENV)
    entries = parse_visible(value)
    gpus = _node_gpus(nvml)
    if entries is None:
        visible = [d for g in gpus for d in _whole(g)]
    else:
        visible = [d for entry in entries for d in _lookup(nvml, entry, gpus, value or "")]
        seen: set[str] = set()
        for d in visible:
            if d.uuid in seen:
                raise DeviceMapError(f"{VISIBLE_ENV}={value!r} names device {d.key} ({d.uuid}) twice")
            seen.add(d.uuid)
        if any(e.isdigit() for e in entries) and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" \
                and len({g.name for g in gpus}) > 1:
            log.warning("%s=%r uses indices on a machine of several GPU models: CUDA's default "
                        "order (fastest first) may differ from NVML's; set CUDA_DEVICE_ORDER="
                        "PCI_BUS_ID or name the GPUs by UUID", VISIBLE_ENV, value)
    raw = env.get("LOCAL_WORLD_SIZE", "1")
    per_node = int(raw) if raw.strip().isdigit() else 0
    if per_node < 1:
        raise DeviceMapError(f"LOCAL_WORLD_SIZE={raw!r}: expected a positive number of ranks "
                             "(torchrun sets it)")
    return visible[:per_node]


@dataclass
class JobGpus:
    """The NVML module and the job's devices it opened, or why it opened none (``unread``)."""

    nvml: Any = None
    devices: list[JobGpu] = field(default_factory=list)
    unread: str | None = None

    @classmethod
    def none(cls) -> JobGpus:
        """No GPU: a CPU job."""
        return cls()

    @classmethod
    def open(cls, env: Mapping[str, str] | None = None) -> JobGpus:
        """Initialise NVML (``pynvml``) and find the job's devices; never raises: what went
        wrong is in ``unread`` and the log."""
        try:
            import pynvml  # nvidia-ml-py: installed with the GPU image (the "gpu" extra)
        except ImportError:
            return cls(unread="pynvml (nvidia-ml-py) is not installed on rank 0's machine")
        try:
            pynvml.nvmlInit()
        except Exception as err:  # NVMLError: no driver, no device
            return cls(unread=f"NVML could not start on rank 0's machine ({err})")
        try:
            devices = job_gpus(pynvml, env)
        except DeviceMapError as err:
            log.warning("GPU energy not metered: %s", err)
            return cls(pynvml, [], str(err))
        except Exception as err:  # an NVMLError while listing the machine's devices
            log.warning("GPU energy not metered: NVML could not list the devices (%s)", err)
            return cls(pynvml, [], f"NVML could not list the devices ({err})")
        if not devices:
            return cls(pynvml, [], f"{VISIBLE_ENV} leaves this process no NVML device")
        log.info("the job's GPUs on this machine: %s", ", ".join(
            f"{d.key} ({d.uuid}{', ' + d.pci_bus_id if d.pci_bus_id else ''})" for d in devices))
        return cls(pynvml, devices)
