"""Rank 0's attempt clock and energy counters: buckets from local timers, RAPL read from a tree."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from trainforge.contract import LEDGER_TAG_PREFIX
from trainforge.ledger.attempts import job_dir_records
from trainforge.trainer.energy import EnergyMeter, rapl_zones
from trainforge.trainer.goodput import AttemptClock, flops_per_token
from trainforge.trainer.gpus import JobGpus, torch_cuda_uuids, uuid_hex


def test_flops_per_token_is_torchtitans():
    # 6 N + 12 l h q t
    assert flops_per_token(1000, 2, 4, 8, 16) == 6 * 1000 + 12 * 2 * 4 * 8 * 16


def test_the_clock_splits_steps_into_data_wait_productive_and_wasted_compute(tmp_path):
    clock = AttemptClock(world_size=2, tokens_per_step=64, flops_per_token=10, device="cpu",
                         started_at=time.time() - 3.0, job_dir=str(tmp_path))
    clock.restored(0.5, resumed_step=10, reached_step=12)
    clock.loop_started()
    assert clock.seconds["startup"] == pytest.approx(2.5, abs=0.1)
    for step in (11, 12, 13):
        clock.step_started()
        for _ in clock.batches(iter([1, 2])):
            time.sleep(0.01)  # compute
        clock.step_done(step)
    clock.saved(0.25)
    rec = clock.record(final=True)
    assert rec["wasted_steps"] == 2 and rec["productive_steps"] == 1 and rec["step"] == 13
    assert rec["seconds"]["wasted"] >= 0.04 and 0.02 <= rec["seconds"]["productive"] < 0.5
    assert rec["seconds"]["save"] == 0.25 and rec["seconds"]["restore"] == 0.5
    assert rec["seconds"]["data_wait"] < 0.02
    assert rec["final"] and "energy_j" not in rec  # no meter: the orchestrator estimates
    (key, value), = clock.snapshot().items()
    assert key == f"{LEDGER_TAG_PREFIX}{int(clock.started_at * 1000)}"
    assert json.loads(value)["resumed_step"] == 10
    assert job_dir_records(tmp_path) == {key: value}  # the same record in the job folder


def test_without_mlflow_an_earlier_attempts_record_in_the_job_folder_marks_retrained_steps(
        tmp_path):
    def clock(started_at):
        return AttemptClock(world_size=1, tokens_per_step=8, flops_per_token=10, device="cpu",
                            started_at=started_at, job_dir=str(tmp_path))

    first = clock(time.time() - 10)
    first.restored(0.0, resumed_step=0, reached_step=0)
    first.loop_started()
    for step in range(1, 8):
        first.step_started()
        first.step_done(step)
    first.snapshot()  # killed after step 7; its newest checkpoint was step 5
    (tmp_path / "ledger" / "attempt-1.json").write_text("{torn")  # an unreadable one is left out

    second = clock(time.time())
    second.restored(0.1, resumed_step=5, reached_step=5)  # no MLflow run: the tracker knew 5
    second.loop_started()
    for step in range(6, 10):
        second.step_started()
        second.step_done(step)
    rec = second.record()
    assert (rec["reached_step"], rec["wasted_steps"], rec["productive_steps"]) == (7, 2, 2)


def _zone(root, name, uj, max_uj=1000):
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text(f"{uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return zone


def test_rapl_packages_are_summed_across_a_wrap_and_subzones_ignored(tmp_path):
    pkg0 = _zone(tmp_path, "intel-rapl:0", 900)
    pkg1 = _zone(tmp_path, "intel-rapl:1", 100)
    _zone(tmp_path, "intel-rapl:0:0", 5)  # a sub-zone (core) of package 0
    meter = EnergyMeter.open(None, powercap_root=tmp_path)
    assert meter.sources == {"cpu": "measured-rapl"} and len(meter.rapl) == 2
    (pkg0 / "energy_uj").write_text("50\n")  # wrapped at 1000: +150 uJ
    (pkg1 / "energy_uj").write_text("400\n")  # +300 uJ
    assert meter.joules() == {"cpu": pytest.approx(450e-6)}


def test_unreadable_or_missing_rapl_leaves_the_cpu_estimated(tmp_path):
    assert rapl_zones(tmp_path / "absent") == []
    zone = _zone(tmp_path, "intel-rapl:0", 1)
    (zone / "energy_uj").unlink()
    (zone / "energy_uj").mkdir()  # reading it fails like a root-only file does
    meter = EnergyMeter.open(None, powercap_root=tmp_path)
    assert meter.sources == {} and meter.joules() == {}
    shutil.rmtree(zone)


@pytest.mark.gpu
def test_nvml_counts_the_gpus_energy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (install a CUDA build of torch and the NVIDIA driver)")
    pytest.importorskip("pynvml", reason="install nvidia-ml-py")
    gpus = JobGpus.open(cuda_uuids=torch_cuda_uuids())  # cuda:0, found in NVML by torch's UUID
    assert len(gpus.devices) == 1 and gpus.devices[0].handle is not None, (gpus.unread, gpus.devices)
    assert uuid_hex(gpus.devices[0].uuid) == uuid_hex(torch_cuda_uuids()[0])
    meter = EnergyMeter.open(gpus)
    assert meter.sources.get("gpu") in ("measured-nvml", "power_integration")
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):
        x = x @ x
        x /= x.norm()
    torch.cuda.synchronize()
    time.sleep(0.2)
    assert meter.joules()["gpu"] > 0
    meter.close()


def test_a_flush_is_due_every_few_seconds_and_replaces_the_record_whole(tmp_path):
    clock = AttemptClock(world_size=1, tokens_per_step=8, flops_per_token=10, device="cpu",
                         job_dir=str(tmp_path))
    clock.loop_started()
    assert not clock.flush_due(0.2)
    time.sleep(0.25)
    assert clock.flush_due(0.2)
    clock.step_started()
    clock.step_done(1)
    clock.snapshot()
    assert not clock.flush_due(0.2)  # a snapshot restarts the interval
    first = json.loads(clock.file.read_text())
    time.sleep(0.25)
    clock.step_started()
    clock.step_done(2)
    assert clock.flush_due(0.2)
    clock.snapshot()
    second = json.loads(clock.file.read_text())
    assert (first["step"], second["step"]) == (1, 2) and second["recorded_at"] > first["recorded_at"]
    assert [p.name for p in clock.file.parent.iterdir()] == [clock.file.name]  # no temporary left


def test_a_checkpoints_record_is_save_time_and_after_the_last_step_nothing_is_productive():
    class SlowRun:  # an MLflow run that takes 0.2 s to take the tags
        tags: dict = {}

        def set_tags(self, tags):
            time.sleep(0.2)
            self.tags = tags

    clock = AttemptClock(world_size=1, tokens_per_step=8, flops_per_token=10, device="cpu")
    clock.loop_started()
    clock.step_started()
    clock.step_done(1)
    run = SlowRun()
    clock.flush(run, saved_s=0.1)  # the checkpoint took 0.1 s, then its record is written
    assert run.tags and clock.seconds["save"] >= 0.3
    clock.step_started()
    clock.step_done(2)
    clock.loop_ended()
    time.sleep(0.2)  # stopping the loop's helpers
    rec = clock.record(final=True)
    assert rec["seconds"]["productive"] < 0.1 and rec["seconds"]["save"] == pytest.approx(0.3, abs=0.05)
