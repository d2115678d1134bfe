"""The job's own GPUs: CUDA_VISIBLE_DEVICES mapped to NVML devices, metered per device (counter,
else integrated power, else unknown), and the only GPUs in MLflow's system metrics. A fake
``pynvml`` module (tests/trainer/fake_nvml.py) stands in for NVML: no GPU needed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.fake_nvml import FakeGpu, fake_nvml
from trainforge.ledger import names as n
from trainforge.ledger.build import build_ledger
from trainforge.ledger.catalog import Price
from trainforge.pipeline import load_spec, validate_overrides
from trainforge.trainer.energy import EnergyMeter
from trainforge.trainer.gpus import DeviceMapError, JobGpus, job_gpus, parse_visible
from trainforge.trainer.tracking import MlflowTracker

DEMO = Path(__file__).resolve().parents[2] / "dags" / "pipelines" / "shakespeare_llm.yaml"


def four_gpus_counter_unsupported() -> list[FakeGpu]:
    """The issue's machine: no total-energy counter anywhere; GPU 3 reads no power either."""
    return [FakeGpu(energy_mj=None, power_w=100.0 + 10 * i) for i in range(3)] + \
        [FakeGpu(energy_mj=None, power_w=None)]


def keys(devices) -> list[str]:
    return [d.key for d in devices]


def test_visible_1_3_meters_gpus_1_and_3_power_on_one_unknown_on_the_other(monkeypatch, tmp_path):
    nvml = fake_nvml(four_gpus_counter_unsupported())
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    env = {"CUDA_VISIBLE_DEVICES": "1,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "LOCAL_WORLD_SIZE": "2"}
    gpus = JobGpus.open(env)
    assert keys(gpus.devices) == ["gpu1", "gpu3"] and gpus.unread is None

    before = time.monotonic()
    meter = EnergyMeter.open(gpus, powercap_root=tmp_path, power_hz=50.0)
    time.sleep(0.3)
    inner = time.monotonic() - before
    record = meter.record()
    outer = time.monotonic() - before
    meter.close()

    assert {d for d, _ in nvml.touched} == {"gpu1", "gpu3"}  # GPUs 0 and 2 never read
    one, three = record["gpus"]["gpu1"], record["gpus"]["gpu3"]
    assert one["source"] == "power_integration" and one["uuid"] == nvml.nvmlDeviceGetUUID(gpus.devices[0].handle)
    assert 110.0 * (inner - 0.05) <= one["energy_j"] <= 110.0 * outer  # 110 W, trapezoid
    assert three["source"] == "unknown" and "energy_j" not in three
    assert "Not Supported" in three["reason"] and "power" in three["reason"]
    assert record["energy_j"] == {"gpu": one["energy_j"]}  # the unknown device adds nothing, not 0
    assert record["energy_source"] == {"gpu": "power_integration"}
    assert "RAPL" in record["energy_unread"]["cpu"]

    # The ledger: per device, the gpu kind mixed, energy and cost partial.
    spec = validate_overrides(load_spec(DEMO), {"training.resources.gpus_per_node": 2,
                                                "training.resources.processes_per_node": 2})
    rec = {"v": 1, "started_at": 1000.0, "first_step_at": 1001.0, "recorded_at": 1010.0,
           "step": 1, "productive_steps": 1, "tokens_per_step": 10, "world_size": 2,
           "device": "NVIDIA H100", "flops_per_token": 1.0,
           "seconds": {"productive": 9.0}} | record
    ledger = build_ledger(spec, {"wall_s": 10.0, "ended_at_epoch_s": 1010.0},
                          {"trainforge.ledger.attempt.1000000": json.dumps(rec)},
                          Price("USD", "spec", "spec", per_gpu_hour=2.0),
                          task_started_s=1000.0, now_s=1010.0, submitted_by_this_try=True)
    t = ledger.tags
    assert t[n.energy_source_tag("gpu1")] == "power_integration"
    assert t[n.energy_source_tag("gpu3")] == "unknown" and "Not Supported" in t[n.energy_reason_tag("gpu3")]
    assert t[n.energy_source_tag("gpu")] == "mixed"
    assert not any(k.startswith(("energy/source/gpu0", "energy/source/gpu2")) for k in t)
    assert t[n.ENERGY_STATUS] == "partial" and t[n.COST_STATUS] == "partial"
    assert ledger.metrics[n.ENERGY_KWH] > 0


def test_system_metrics_are_logged_for_the_jobs_gpus_only(monkeypatch, tmp_path):
    from mlflow import MlflowClient
    from mlflow.system_metrics.metrics import gpu_monitor

    nvml = fake_nvml(four_gpus_counter_unsupported())
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_monitor, "pynvml", nvml, raising=False)  # MLflow's own monitor: every GPU
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = MlflowClient(uri).create_run(MlflowClient(uri).create_experiment("gpus")).info.run_id
    gpus = JobGpus.open({"CUDA_VISIBLE_DEVICES": "1,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                         "LOCAL_WORLD_SIZE": "2"})
    with MlflowTracker(uri, run_id).system_metrics(interval_s=60.0, gpus=gpus):
        time.sleep(0.2)
    metrics = MlflowClient(uri).get_run(run_id).data.metrics
    gpu_metrics = {k for k in metrics if k.startswith("system/gpu_")}
    assert {"system/gpu_1_utilization_percentage", "system/gpu_3_utilization_percentage",
            "system/gpu_1_power_usage_watts"} <= gpu_metrics
    assert not any(k.startswith(("system/gpu_0_", "system/gpu_2_")) for k in gpu_metrics)
    assert metrics["system/gpu_1_power_usage_watts"] == pytest.approx(110.0)
    assert "system/gpu_3_power_usage_watts" not in metrics  # NVML reads no power of GPU 3
    assert "system/cpu_utilization_percentage" in metrics  # MLflow's other monitors stay


def test_uuid_prefixes_and_mig_uuids_name_the_devices():
    machine = [FakeGpu(), FakeGpu(), FakeGpu(uuid="GPU-5b6c0d1e-0000-0000-0000-000000000002"),
               FakeGpu(migs=["MIG-aaaa1111-0000-0000-0000-000000000000",
                             "MIG-bbbb2222-0000-0000-0000-000000000000"])]
    nvml = fake_nvml(machine)
    env = {"CUDA_VISIBLE_DEVICES": "GPU-5b6c0d1e,MIG-bbbb2222-0000-0000-0000-000000000000",
           "LOCAL_WORLD_SIZE": "2"}
    found = job_gpus(nvml, env)
    assert keys(found) == ["gpu2", "gpu3-mig1"]
    assert found[1].uuid.startswith("MIG-bbbb2222") and found[1].index == 3 and found[1].mig == 1
    # The older form: the parent's UUID, then the GPU instance and compute instance ids.
    legacy = f"MIG-{machine[3].uuid}/10/0"
    assert keys(job_gpus(nvml, {"CUDA_VISIBLE_DEVICES": legacy})) == ["gpu3-mig0"]
    # An index naming a GPU in MIG mode stands for its instances, never the whole board.
    pci = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert keys(job_gpus(nvml, pci | {"CUDA_VISIBLE_DEVICES": "3", "LOCAL_WORLD_SIZE": "2"})) == \
        ["gpu3-mig0", "gpu3-mig1"]
    # Unset: every device of the machine, the node's ranks using the first LOCAL_WORLD_SIZE.
    assert keys(job_gpus(nvml, pci | {"LOCAL_WORLD_SIZE": "5"})) == \
        ["gpu0", "gpu1", "gpu2", "gpu3-mig0", "gpu3-mig1"]
    assert keys(job_gpus(nvml, pci)) == ["gpu0"]


def test_a_mig_instance_is_metered_as_unknown_not_as_its_board(tmp_path):
    nvml = fake_nvml([FakeGpu(migs=["MIG-aaaa1111-0000-0000-0000-000000000000"])])
    gpus = JobGpus(nvml, job_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "MIG-aaaa1111"}))
    record = EnergyMeter.open(gpus, powercap_root=tmp_path).record()
    assert record["gpus"]["gpu0-mig0"]["source"] == "unknown" and "energy_j" not in record
    assert ("gpu0", "energy") not in nvml.touched and ("gpu0", "power") not in nvml.touched


@pytest.mark.parametrize("value, entries", [
    (None, None), ("", []), ("-1", []), ("0,-1,2", ["0"]), (" 1, 3 ", ["1", "3"]),
    ("GPU-abc,MIG-def", ["GPU-abc", "MIG-def"]),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value, entries):
    assert parse_visible(value) == entries


@pytest.mark.parametrize("env, message", [
    ({"CUDA_VISIBLE_DEVICES": "1,gpu2"}, "entry 'gpu2' is neither a device index"),
    ({"CUDA_VISIBLE_DEVICES": "1,,2"}, "entry '' is neither"),
    ({"CUDA_VISIBLE_DEVICES": "4"}, "lists 4 GPU(s), indices 0..3"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-0000"}, "4 GPU(s) of this machine have a UUID starting so"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-ffff"}, "no GPU(s) of this machine"),
    ({"CUDA_VISIBLE_DEVICES": "MIG-ffff"}, "no MIG instance(s)"),
    ({"CUDA_VISIBLE_DEVICES": "1,GPU-00000001", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
     "names device gpu1 (GPU-00000001"),
    ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0': expected a positive number"),
    ({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE='two': expected a positive number"),
])
def test_a_bad_device_list_is_a_clear_error(env, message):
    with pytest.raises(DeviceMapError) as err:
        job_gpus(fake_nvml([FakeGpu() for _ in range(4)]), env)
    assert message in str(err.value)


def test_what_cannot_be_opened_says_why(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    gpus = JobGpus.open({})
    assert gpus.devices == [] and "not installed" in gpus.unread
    assert EnergyMeter.open(gpus, powercap_root=tmp_path).record()["energy_unread"]["gpu"] == gpus.unread
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([FakeGpu()]))
    bad = JobGpus.open({"CUDA_VISIBLE_DEVICES": "7"})
    assert bad.devices == [] and "CUDA_VISIBLE_DEVICES='7'" in bad.unread


def test_the_counter_is_used_where_supported_and_a_failing_reading_becomes_unknown(tmp_path):
    machine = [FakeGpu(energy_mj=5_000_000), FakeGpu(energy_mj=None, power_w=200.0)]
    nvml = fake_nvml(machine)
    gpus = JobGpus(nvml, job_gpus(nvml, {"LOCAL_WORLD_SIZE": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    meter = EnergyMeter.open(gpus, powercap_root=tmp_path, power_hz=100.0)
    machine[0].energy_mj += 42_000  # 42 J since open
    first = meter.record()["gpus"]
    assert first["gpu0"] == {"uuid": machine[0].uuid, "pci_bus_id": "00000000:18:00.0", "local_rank": 0,
                             "source": "measured-nvml", "energy_j": 42.0}
    assert first["gpu1"]["source"] == "power_integration"
    machine[1].power_w = None  # the power reading stops working mid-attempt
    time.sleep(0.05)
    later = meter.record()
    meter.close()
    assert later["gpus"]["gpu1"]["source"] == "unknown"
    assert "power reading failed" in later["gpus"]["gpu1"]["reason"]
    assert later["energy_source"] == {"gpu": "measured-nvml"} and later["energy_j"]["gpu"] == 42.0
