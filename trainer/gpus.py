"""The job's own GPUs on this machine, as NVML handles: what the energy meter and the
system-metrics monitor read, and nothing else on a shared node.

    gpus = JobGpus.open(cuda_uuids=torch_cuda_uuids())  # LOCAL_WORLD_SIZE, NVML (pynvml)
    gpus.devices   # [JobGpu(key="gpu1", local_rank=0, ...), JobGpu(key="cuda1", handle=None, ...)]
    gpus.unread    # why none could be opened ("pynvml is not installed"), else None

Local rank *r* trains on ``cuda:r``; the node's ranks are the first ``LOCAL_WORLD_SIZE``. Each
rank's device is found in NVML by identity, never by a bare index that could be a neighbour's:

1. the UUID torch reports for ``cuda:r`` (its device properties), matched to a GPU's or a MIG
   instance's UUID;
2. else entry *r* of ``CUDA_VISIBLE_DEVICES``: a ``GPU-``/``MIG-`` UUID (or a unique prefix, or
   ``MIG-GPU-<uuid>/<gi>/<ci>``) by that UUID; an index (or the variable unset: every device in
   CUDA's order) only under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, NVML's order, or on a machine of
   one GPU. Under CUDA's default order (fastest first) an index says nothing about which GPU:
   that rank's device is kept unidentified (``handle`` None, key ``cuda<r>``, ``reason``) and its
   energy is unknown, never booked to a guessed GPU.

A GPU in MIG mode is never metered as a whole board: an index or UUID naming one stands for its
MIG instances, each recorded with its parent's UUID. Ledger names (``key``): ``gpu<NVML index>``,
``gpu<parent index>-mig<instance index>`` as in nvidia-smi. The rules: docs/contracts.md.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

log = logging.getLogger(__name__)

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
ORDER_ENV = "CUDA_DEVICE_ORDER"
PCI_ORDER = "PCI_BUS_ID"
_INDEX = re.compile(r"^[+-]?\d+$")
_LEGACY_MIG = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)$")
_HEX_UUID = re.compile(r"^[0-9a-f]{32}$")


class DeviceMapError(ValueError):
    """``CUDA_VISIBLE_DEVICES`` names a device this machine's NVML does not have, or twice."""


@dataclass(frozen=True)
class JobGpu:
    """One rank's device on this machine: its ledger name, NVML handle and identity; an
    unidentified one (module docstring) has no handle, UUID or index, and says why."""

    key: str
    handle: Any = field(compare=False, repr=False)
    uuid: str | None
    index: int | None
    """NVML index of the GPU (of the parent GPU for a MIG instance)."""
    mig: int | None = None
    """The MIG instance's index on its parent GPU; None for a whole GPU."""
    pci_bus_id: str | None = None
    parent_uuid: str | None = None
    """A MIG instance's GPU (the board it is a slice of); None for a whole GPU."""
    local_rank: int | None = None
    """The rank that trains on it (``cuda:<local_rank>``)."""
    reason: str | None = None
    """Why it is unidentified; None when NVML's device is known."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_error(nvml: Any) -> type[BaseException]:
    return getattr(nvml, "NVMLError", Exception)


def uuid_hex(value: Any) -> str | None:
    """The 32 hex digits of a device UUID in any of its spellings (NVML's ``GPU-…``/``MIG-…``,
    torch's bare ``xxxxxxxx-…``, 16 raw bytes); None when ``value`` is no such UUID."""
    if isinstance(value, (bytes, bytearray)) and len(value) == 16:
        return bytes(value).hex()
    text = _text(value).strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    text = text.replace("-", "")
    return text if _HEX_UUID.match(text) else None


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
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        gpus.append(_Gpu(i, handle, uuid, bus, name, _mig_instances(nvml, i, handle, uuid, bus)))
    return gpus


def _mig_instances(nvml: Any, index: int, handle: Any, uuid: str,
                   bus: str | None) -> list[JobGpu] | None:
    """The MIG instances NVML lets this process see on a GPU in MIG mode, each with its parent's
    ``uuid``; None when the GPU is not in MIG mode."""
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
                            bus, parent_uuid=uuid))
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


def _unidentified(why: str) -> JobGpu:
    """A rank's device NVML cannot be told (key and rank set by :func:`job_gpus`)."""
    return JobGpu("", None, None, None, reason=why)


def _lookup(nvml: Any, entry: str, gpus: list[_Gpu], value: str, order: str | None) -> list[JobGpu]:
    """The device(s) one ``CUDA_VISIBLE_DEVICES`` entry names (module docstring)."""
    where = f"{VISIBLE_ENV}={value!r}: entry {entry!r}"
    if entry.isdigit():
        index = int(entry)
        if index >= len(gpus):
            raise DeviceMapError(f"{where}: this machine's NVML lists {len(gpus)} GPU(s), "
                                 f"indices 0..{len(gpus) - 1}")
        if order != PCI_ORDER and len(gpus) > 1:
            return [_unidentified(f"{where} is an index in CUDA's {order or 'FASTEST_FIRST'} "
                                  f"order ({ORDER_ENV}), which is not NVML's: which of the "
                                  f"machine's {len(gpus)} GPUs it is cannot be told; set "
                                  f"{ORDER_ENV}={PCI_ORDER} or name the GPUs by UUID")]
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


def _from_env(nvml: Any, env: Mapping[str, str], gpus: list[_Gpu]) -> list[JobGpu]:
    """The devices ``CUDA_VISIBLE_DEVICES`` gives the process, in CUDA's order (module
    docstring), unidentified where an index cannot be resolved."""
    value, order = env.get(VISIBLE_ENV), env.get(ORDER_ENV)
    entries = parse_visible(value)
    if entries is None:  # every device of the machine, in CUDA's order
        if order == PCI_ORDER or len(gpus) < 2:
            return [d for g in gpus for d in _whole(g)]
        why = (f"{VISIBLE_ENV} is unset and {ORDER_ENV} is {order or 'unset (FASTEST_FIRST)'}: "
               f"CUDA orders the machine's {len(gpus)} GPUs fastest first, not as NVML does, so "
               f"which GPU a rank uses cannot be told; set {ORDER_ENV}={PCI_ORDER} or "
               f"{VISIBLE_ENV} to GPU UUIDs")
        return [_unidentified(why) for _ in gpus]
    visible = [d for entry in entries for d in _lookup(nvml, entry, gpus, value or "", order)]
    seen: set[str] = set()
    for d in visible:
        if d.uuid is not None and d.uuid in seen:
            raise DeviceMapError(f"{VISIBLE_ENV}={value!r} names device {d.key} ({d.uuid}) twice")
        seen.add(d.uuid or "")
    return visible


def _from_uuid(raw: str, rank: int, gpus: list[_Gpu]) -> JobGpu | None:
    """The device whose UUID torch reports for ``cuda:<rank>``; unidentified when NVML lists none;
    None when the UUID is a board in MIG mode (an older CUDA's answer: fall back to the list)."""
    wanted = uuid_hex(raw)
    if wanted is None:
        return None
    for gpu in gpus:
        if uuid_hex(gpu.uuid) == wanted:
            return None if gpu.migs is not None else _whole(gpu)[0]
        for mig in gpu.migs or []:
            if uuid_hex(mig.uuid) == wanted:
                return mig
    return _unidentified(f"torch's cuda:{rank} has UUID {raw}, which no GPU or MIG instance "
                         "this machine's NVML lists has")


def job_gpus(nvml: Any, env: Mapping[str, str] | None = None,
             cuda_uuids: list[str | None] | None = None) -> list[JobGpu]:
    """Each local rank's device on this machine (module docstring), from an initialised ``nvml``;
    ``cuda_uuids[r]``: the UUID torch reports for ``cuda:r`` (None, or past the list: unknown).

    Raises:
        DeviceMapError: ``CUDA_VISIBLE_DEVICES`` names an unknown device, or one twice, or
            ``LOCAL_WORLD_SIZE`` is not a positive number.
    """
    env = os.environ if env is None else env
    raw = env.get("LOCAL_WORLD_SIZE", "1")
    per_node = int(raw) if raw.strip().isdigit() else 0
    if per_node < 1:
        raise DeviceMapError(f"LOCAL_WORLD_SIZE={raw!r}: expected a positive number of ranks "
                             "(torchrun sets it)")
    gpus = _node_gpus(nvml)
    uuids = list(cuda_uuids or [])[:per_node]
    by_uuid = [_from_uuid(u, r, gpus) if u else None for r, u in enumerate(uuids)]
    listed: list[JobGpu] | None = None
    devices = []
    for r in range(per_node):
        found = by_uuid[r] if r < len(by_uuid) else None
        if found is None:  # torch gave no usable UUID: CUDA_VISIBLE_DEVICES (module docstring)
            listed = _from_env(nvml, env, gpus) if listed is None else listed
            if r >= len(listed):
                break  # fewer devices than ranks: the ranks beyond have none on this machine
            found = listed[r]
        devices.append(replace(found, local_rank=r, key=found.key or f"cuda{r}"))
    ranks: dict[str, int] = {}
    for d in devices:  # torch's UUIDs and the list could disagree: never book one GPU twice
        if d.uuid is not None and ranks.setdefault(d.uuid, d.local_rank) != d.local_rank:
            raise DeviceMapError(f"local ranks {ranks[d.uuid]} and {d.local_rank} both map to "
                                 f"device {d.key} ({d.uuid}); {VISIBLE_ENV}="
                                 f"{env.get(VISIBLE_ENV)!r}")
    return devices


def torch_cuda_uuids() -> list[str | None]:
    """The UUID torch reports for each visible CUDA device (``cuda:0``, ``cuda:1``, ...), from
    its device properties; None for one whose properties carry no UUID (an older torch)."""
    import torch  # the trainer's: only rank 0 of a CUDA job calls this

    found: list[str | None] = []
    for i in range(torch.cuda.device_count()):
        raw = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        found.append(None if raw is None else _text(raw))
    return found


@dataclass
class JobGpus:
    """The NVML module and each local rank's device it found, or why it opened none (``unread``)."""

    nvml: Any = None
    devices: list[JobGpu] = field(default_factory=list)
    unread: str | None = None

    @property
    def identified(self) -> list[JobGpu]:
        """The devices NVML can read (an unidentified one's energy is unknown)."""
        return [d for d in self.devices if d.handle is not None]

    @classmethod
    def none(cls) -> JobGpus:
        """No GPU: a CPU job."""
        return cls()

    @classmethod
    def open(cls, env: Mapping[str, str] | None = None,
             cuda_uuids: list[str | None] | None = None) -> JobGpus:
        """Initialise NVML (``pynvml``) and find each local rank's device (``cuda_uuids``: torch's,
        :func:`torch_cuda_uuids`); never raises: what went wrong is in ``unread`` and the log."""
        try:
            import pynvml  # nvidia-ml-py: installed with the GPU image (the "gpu" extra)
        except ImportError:
            return cls(unread="pynvml (nvidia-ml-py) is not installed on rank 0's machine")
        try:
            pynvml.nvmlInit()
        except Exception as err:  # NVMLError: no driver, no device
            return cls(unread=f"NVML could not start on rank 0's machine ({err})")
        try:
            devices = job_gpus(pynvml, env, cuda_uuids)
        except DeviceMapError as err:
            log.warning("GPU energy not metered: %s", err)
            return cls(pynvml, [], str(err))
        except Exception as err:  # an NVMLError while listing the machine's devices
            log.warning("GPU energy not metered: NVML could not list the devices (%s)", err)
            return cls(pynvml, [], f"NVML could not list the devices ({err})")
        if not devices:
            return cls(pynvml, [], f"{VISIBLE_ENV} leaves this process no NVML device")
        for d in devices:
            if d.handle is None:
                log.warning("GPU energy of local rank %d unknown: %s", d.local_rank, d.reason)
        log.info("the job's GPUs on this machine: %s", ", ".join(
            f"cuda:{d.local_rank} = {d.key} ({d.uuid}{', ' + d.pci_bus_id if d.pci_bus_id else ''}"
            f"{', on ' + d.parent_uuid if d.parent_uuid else ''})" for d in devices if d.handle is not None)
            or "none identified")
        return cls(pynvml, devices)
