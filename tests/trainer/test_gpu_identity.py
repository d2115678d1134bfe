"""Each local rank's GPU found in NVML by identity: torch's UUID for ``cuda:r``, else a UUID in
CUDA_VISIBLE_DEVICES, else an index only in PCI bus order; under CUDA's default order (fastest
first) a bare index is unidentified and its energy unknown, never a neighbour's. A MIG instance
records its parent GPU. A fake ``pynvml`` (tests/trainer/fake_nvml.py) stands in for the driver."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from tests.trainer.fake_nvml import FakeGpu, fake_nvml
from trainforge.ledger import names as n
from trainforge.ledger.build import build_ledger
from trainforge.ledger.catalog import Price
from trainforge.pipeline import load_spec, validate_overrides
from trainforge.trainer.energy import EnergyMeter
from trainforge.trainer.gpus import JobGpus, job_gpus, torch_cuda_uuids, uuid_hex

DEMO = Path(__file__).resolve().parents[2] / "dags" / "pipelines" / "shakespeare_llm.yaml"
H100 = "NVIDIA H100 80GB HBM3"
FASTEST_FIRST = [1, 0]
"""CUDA's order on the machine below: ``cuda:0`` is NVML's GPU 1 (its fastest-first pick among
two identical boards; the CUDA documentation leaves the order of equals unspecified)."""


def torch_spelling(nvml_uuid: str) -> str:
    """A UUID as torch's device properties print it: the bare 8-4-4-4-12 form, no ``GPU-``."""
    return str(uuid.UUID(nvml_uuid.split("-", 1)[1]))


def two_identical_gpus() -> list[FakeGpu]:
    """Two boards of one model; their counters tell apart which one a figure came from."""
    return [FakeGpu(name=H100, energy_mj=1_000_000), FakeGpu(name=H100, energy_mj=9_000_000)]


def cuda_uuids(machine: list[FakeGpu]) -> list[str]:
    """What torch reports for cuda:0, cuda:1 on that machine, in CUDA's (fastest-first) order."""
    return [torch_spelling(machine[i].uuid) for i in FASTEST_FIRST]


def metered(machine: list[FakeGpu], nvml, gpus: JobGpus, tmp_path) -> dict:
    """The attempt record's ``gpus`` after GPU 0 used 10 J and GPU 1 used 70 J."""
    meter = EnergyMeter.open(gpus, powercap_root=tmp_path)
    machine[0].energy_mj += 10_000
    machine[1].energy_mj += 70_000
    record = meter.record()
    meter.close()
    return record


def test_torchs_uuid_books_each_ranks_energy_to_its_own_gpu_under_fastest_first(monkeypatch, tmp_path):
    machine = two_identical_gpus()
    nvml = fake_nvml(machine)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    # One rank, CUDA_VISIBLE_DEVICES unset, CUDA's default order: cuda:0 is NVML's GPU 1.
    gpus = JobGpus.open({"LOCAL_WORLD_SIZE": "1"}, cuda_uuids=cuda_uuids(machine))
    record = metered(machine, nvml, gpus, tmp_path)
    assert record["gpus"] == {"gpu1": {"uuid": machine[1].uuid, "pci_bus_id": "00000000:19:00.0",
                                       "local_rank": 0, "source": "measured-nvml", "energy_j": 70.0}}
    assert record["energy_j"]["gpu"] == 70.0
    assert {d for d, what in nvml.touched if what == "energy"} == {"gpu1"}  # GPU 0 never read

    # Two ranks: each in CUDA's order, each booked to its own UUID.
    machine = two_identical_gpus()
    nvml = fake_nvml(machine)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpus = JobGpus.open({"LOCAL_WORLD_SIZE": "2"}, cuda_uuids=cuda_uuids(machine))
    assert [(d.local_rank, d.key) for d in gpus.devices] == [(0, "gpu1"), (1, "gpu0")]
    both = metered(machine, nvml, gpus, tmp_path)["gpus"]
    assert (both["gpu1"]["uuid"], both["gpu1"]["energy_j"]) == (machine[1].uuid, 70.0)
    assert (both["gpu0"]["uuid"], both["gpu0"]["energy_j"]) == (machine[0].uuid, 10.0)


def test_a_bare_index_under_fastest_first_is_unknown_never_a_guessed_gpu(monkeypatch, tmp_path):
    machine = two_identical_gpus()
    nvml = fake_nvml(machine)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    # No UUID from torch; "0" means CUDA's first device, NVML's GPU 1 (FASTEST_FIRST), not GPU 0.
    gpus = JobGpus.open({"CUDA_VISIBLE_DEVICES": "0", "LOCAL_WORLD_SIZE": "1"})
    record = metered(machine, nvml, gpus, tmp_path)
    assert list(record["gpus"]) == ["cuda0"]
    entry = record["gpus"]["cuda0"]
    assert entry["source"] == "unknown" and "energy_j" not in entry and "uuid" not in entry
    assert "FASTEST_FIRST" in entry["reason"] and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in entry["reason"]
    assert "gpu" not in record.get("energy_j", {}) and "gpu" not in record.get("energy_unread", {})
    assert not [d for d, what in nvml.touched if what in ("energy", "power")]  # no GPU guessed
    # Unset as well: every GPU in CUDA's order, which NVML's is not.
    unset = job_gpus(nvml, {"LOCAL_WORLD_SIZE": "2"})
    assert [(d.key, d.handle, d.uuid) for d in unset] == [("cuda0", None, None), ("cuda1", None, None)]
    assert "CUDA_VISIBLE_DEVICES is unset" in unset[0].reason

    # The ledger: the device and the gpu kind unknown with the reason, not estimated as a board.
    spec = validate_overrides(load_spec(DEMO), {"training.resources.gpus_per_node": 1,
                                                "training.resources.processes_per_node": 1})
    rec = {"v": 1, "started_at": 1000.0, "first_step_at": 1001.0, "recorded_at": 1010.0,
           "step": 1, "productive_steps": 1, "tokens_per_step": 10, "world_size": 1,
           "device": H100, "flops_per_token": 1.0, "seconds": {"productive": 9.0}} | record
    ledger = build_ledger(spec, {"wall_s": 10.0, "ended_at_epoch_s": 1010.0},
                          {"trainforge.ledger.attempt.1000000": json.dumps(rec)},
                          Price("USD", "spec", "spec", per_gpu_hour=2.0),
                          task_started_s=1000.0, now_s=1010.0, submitted_by_this_try=True)
    t = ledger.tags
    assert t[n.energy_source_tag("cuda0")] == "unknown"
    assert "FASTEST_FIRST" in t[n.energy_reason_tag("cuda0")]
    assert t[n.energy_source_tag("gpu")] == "unknown" and t[n.ENERGY_STATUS] == "partial"
    assert not any(k.startswith(("energy/source/gpu0", "energy/source/gpu1")) for k in t)


@pytest.mark.parametrize("env, key", [
    ({"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, "gpu0"),  # NVML's order
    ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, "gpu0"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-00000001"}, "gpu1"),  # a UUID prefix names it in any order
])
def test_without_torchs_uuid_the_list_resolves_only_by_uuid_or_pci_order(env, key):
    (device,) = job_gpus(fake_nvml(two_identical_gpus()), env)
    assert device.key == key and device.handle is not None and device.local_rank == 0


def test_one_gpu_machine_resolves_an_index_in_any_order():
    (device,) = job_gpus(fake_nvml([FakeGpu()]), {"CUDA_VISIBLE_DEVICES": "0"})
    assert device.key == "gpu0"


def test_a_mig_instance_records_its_parent_gpus_uuid(tmp_path):
    machine = [FakeGpu(name=H100), FakeGpu(name=H100, migs=["MIG-aaaa1111-0000-0000-0000-000000000000",
                                                           "MIG-bbbb2222-0000-0000-0000-000000000000"])]
    nvml = fake_nvml(machine)
    # torch's UUID for cuda:0 is the instance's own (MIG-bbbb2222...).
    gpus = JobGpus(nvml, job_gpus(nvml, {}, cuda_uuids=[torch_spelling(machine[1].migs[1])]))
    entry = EnergyMeter.open(gpus, powercap_root=tmp_path).record()["gpus"]["gpu1-mig1"]
    assert entry["uuid"] == machine[1].migs[1] and entry["parent_uuid"] == machine[1].uuid
    assert entry["source"] == "unknown"  # NVML reads no energy of a MIG instance
    # Named in CUDA_VISIBLE_DEVICES, the same parent.
    (by_list,) = job_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "MIG-aaaa1111"})
    assert (by_list.key, by_list.parent_uuid) == ("gpu1-mig0", machine[1].uuid)
    # A whole GPU has no parent.
    (whole,) = job_gpus(nvml, {}, cuda_uuids=[torch_spelling(machine[0].uuid)])
    assert (whole.key, whole.parent_uuid) == ("gpu0", None)
    # torch naming the board in MIG mode (an older CUDA) says nothing of the instance: the list does.
    (fallback,) = job_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "MIG-bbbb2222"},
                           cuda_uuids=[torch_spelling(machine[1].uuid)])
    assert fallback.key == "gpu1-mig1"


def test_a_uuid_no_nvml_device_has_is_unknown_and_two_ranks_on_one_gpu_an_error():
    nvml = fake_nvml(two_identical_gpus())
    (device,) = job_gpus(nvml, {}, cuda_uuids=["12345678-0000-0000-0000-000000000000"])
    assert device.key == "cuda0" and "which no GPU or MIG instance" in device.reason
    with pytest.raises(ValueError, match="local ranks 0 and 1 both map to device gpu1"):
        job_gpus(nvml, {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "GPU-00000000,GPU-00000001"},
                 cuda_uuids=[torch_spelling(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(1)))])


@pytest.mark.parametrize("value, hex_", [
    ("GPU-5b6c0d1e-aaaa-bbbb-cccc-000000000002", "5b6c0d1eaaaabbbbcccc000000000002"),
    ("5B6C0D1E-AAAA-BBBB-CCCC-000000000002", "5b6c0d1eaaaabbbbcccc000000000002"),  # torch's form
    ("MIG-aaaa1111-0000-0000-0000-000000000000", "aaaa1111000000000000000000000000"),
    (bytes.fromhex("5b6c0d1eaaaabbbbcccc000000000002"), "5b6c0d1eaaaabbbbcccc000000000002"),
    ("GPU-5b6c", None), ("MIG-GPU-5b6c0d1e-aaaa-bbbb-cccc-000000000002/1/0", None), ("", None),
])
def test_uuid_spellings_compare_by_their_hex_digits(value, hex_):
    assert uuid_hex(value) == hex_


def test_torch_reports_no_uuid_without_a_cuda_device():
    torch = pytest.importorskip("torch")
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert len(torch_cuda_uuids()) == expected
