"""The job's energy per kind and per GPU device: read, else estimated with the reason, else
unknown (never 0); partial energy and cost; the source per device in the report and the UI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from trainforge.cli.report import print_report
from trainforge.ledger import names as n
from trainforge.ledger.build import build_ledger
from trainforge.ledger.catalog import Price
from trainforge.ledger.energy import job_energy
from trainforge.ledger.read import ledger_figures, ledger_line
from trainforge.pipeline import load_spec, validate_overrides
from trainforge.plugins.ui.ledger import figures

DEMO = Path(__file__).resolve().parents[3] / "dags" / "pipelines" / "shakespeare_llm.yaml"


@pytest.fixture
def gpu_spec():
    return validate_overrides(load_spec(DEMO), {"training.resources.gpus_per_node": 2,
                                                "training.resources.processes_per_node": 2})


def record(started: float, **energy) -> dict:
    return {"v": 1, "started_at": started, "first_step_at": started + 1, "recorded_at": started + 10,
            "step": 1, "productive_steps": 1, "tokens_per_step": 10, "world_size": 2,
            "device": "NVIDIA H100", "flops_per_token": 1.0, "seconds": {"productive": 9.0}, **energy}


def device(source: str, joules: float | None = None, reason: str | None = None) -> dict:
    out = {"uuid": "GPU-x", "source": source}
    if joules is not None:
        out["energy_j"] = joules
    if reason:
        out["reason"] = reason
    return out


RAPL = {"energy_j": {"cpu": 3.6e6}, "energy_source": {"cpu": "measured-rapl"}}


def test_a_job_without_gpu_readings_is_estimated_from_the_spec_with_the_reason(gpu_spec):
    unread = {"energy_unread": {"gpu": "pynvml (nvidia-ml-py) is not installed on rank 0's machine"}}
    energy = job_energy(gpu_spec, [record(0, **RAPL, **unread)], 4.0, 10.0)
    assert energy.sources == {"gpu": "estimated", "cpu": "measured-rapl"}
    assert energy.kwh["gpu"] == pytest.approx(4.0 * 0.7)  # 4 GPU-h x the spec's 700 W
    why = energy.reasons["gpu"]
    assert "1 of 1 attempt(s) read no GPU energy: pynvml (nvidia-ml-py) is not installed" in why
    assert "cost.gpu_power_watts 700 W x 4 GPU-h" in why
    assert energy.status == "partial"
    # No attempt record at all: estimated, and says so.
    assert "no attempt record" in job_energy(gpu_spec, [], 4.0, 10.0).reasons["gpu"]
    # One attempt read the GPUs, one did not: the whole kind is estimated over the allocation.
    read = record(0, gpus={"gpu1": device("measured-nvml", 7.2e6)})
    mixed = job_energy(gpu_spec, [read, record(20)], 4.0, 10.0)
    assert mixed.sources["gpu"] == "estimated" and "gpu1" not in mixed.sources
    assert "1 of 2 attempt(s)" in mixed.reasons["gpu"] and "recorded no reason" in mixed.reasons["gpu"]


def test_zero_watts_gives_no_estimate_but_unknown(gpu_spec):
    spec = validate_overrides(gpu_spec, {"cost.gpu_power_watts": 0.0})
    energy = job_energy(spec, [record(0, **RAPL)], 4.0, 10.0)
    assert energy.sources["gpu"] == "unknown" and "gpu" not in energy.kwh
    assert "0 W, so there is no estimate" in energy.reasons["gpu"] and energy.status == "partial"


def test_devices_read_in_every_attempt_are_summed_with_their_weakest_source(gpu_spec):
    first = record(0, **RAPL, gpus={"gpu1": device("measured-nvml", 3.6e6),
                                    "gpu3": device("measured-nvml", 1.8e6)})
    second = record(20, **RAPL, gpus={"gpu1": device("measured-nvml", 3.6e6),
                                      "gpu3": device("power_integration", 1.8e6)})
    spec = validate_overrides(gpu_spec, {"training.engine": "slurm", "training.resources.nodes": 2})
    energy = job_energy(spec, [first, second], 4.0, 10.0)
    assert energy.sources == {"gpu1": "measured-nvml", "gpu3": "power_integration",
                              "gpu": "mixed", "cpu": "measured-rapl"}
    assert energy.device_kwh == {"gpu1": pytest.approx(2.0), "gpu3": pytest.approx(1.0)}
    assert energy.kwh["gpu"] == pytest.approx(3.0 * 2)  # rank 0's machine x 2 nodes
    assert energy.status == "complete" and energy.reasons == {}


def test_a_device_unknown_in_any_attempt_is_unknown_and_the_energy_partial(gpu_spec):
    why = "NVML reads neither its total-energy counter (Not Supported) nor its power (Not Supported)"
    only_unknown = record(0, **RAPL, gpus={"gpu0-mig1": device("unknown", reason=why)})
    energy = job_energy(gpu_spec, [only_unknown], 4.0, 10.0)
    assert energy.sources["gpu0-mig1"] == "unknown" and energy.reasons["gpu0-mig1"] == why
    assert energy.sources["gpu"] == "unknown" and "gpu" not in energy.kwh  # never 0
    assert energy.status == "partial"
    later = record(20, **RAPL, gpus={"gpu0-mig1": device("power_integration", 3.6e6)})
    both = job_energy(gpu_spec, [only_unknown, later], 4.0, 10.0)
    assert both.sources["gpu0-mig1"] == "unknown" and both.kwh["gpu"] == pytest.approx(1.0)


def test_a_record_from_before_per_device_metering_still_counts(gpu_spec):
    old = record(0, energy_j={"gpu": 7.2e6, "cpu": 3.6e6},
                 energy_source={"gpu": "measured-nvml", "cpu": "measured-rapl"})
    energy = job_energy(gpu_spec, [old], 4.0, 10.0)
    assert energy.sources == {"gpu": "measured-nvml", "cpu": "measured-rapl"}
    assert energy.kwh == {"gpu": pytest.approx(2.0), "cpu": pytest.approx(1.0)}
    assert energy.status == "complete"


def test_the_report_and_the_run_view_show_the_source_per_device(gpu_spec):
    rec = record(1000.0, **RAPL, gpus={"gpu1": device("power_integration", 3.6e6),
                                       "gpu3": device("unknown", reason="Not Supported")})
    ledger = build_ledger(gpu_spec, {"wall_s": 10.0, "ended_at_epoch_s": 1010.0},
                          {"trainforge.ledger.attempt.1000000": json.dumps(rec)},
                          Price("USD", "spec", "spec", per_gpu_hour=2.0),
                          task_started_s=1000.0, now_s=1010.0, submitted_by_this_try=True)
    t = ledger.tags
    assert t[n.ENERGY_STATUS] == t[n.COST_STATUS] == "partial"
    assert t[n.energy_reason_tag("gpu3")] == "Not Supported"
    read = ledger_figures(ledger.metrics, t)
    line = ledger_line(read)
    assert "cpu measured-rapl/gpu mixed/gpu1 power_integration/gpu3 unknown, partial" in line
    assert "USD (partial)" in line

    console = Console(record=True, width=300)
    print_report({"pipeline": "p", "runs": [{"mlflow_run_id": "r", "airflow_run_id": None,
                                             "status": "FINISHED", "figures": read["figures"],
                                             "tags": read["tags"], "validation": {}}],
                  "versions": []}, console)
    text = console.export_text()
    assert "gpu1 power_integration" in text and "gpu3 unknown" in text and "(partial)" in text

    view = figures(ledger.metrics, t)
    assert view["energy_source"]["gpu1"] == "power_integration"
    assert view["energy_source"]["gpu3"] == "unknown"
    assert view["energy_reason"] == {"gpu3": "Not Supported"}
    assert view["energy_status"] == view["cost_status"] == "partial"


def test_a_staged_run_is_partial_when_any_stage_is():
    from trainforge.cli.report import _combined

    metrics = {f"stage/{s}/{n.GOODPUT}": 50.0 for s in ("a", "b")}
    tags = {f"stage/a/{n.ENERGY_STATUS}": "partial", f"stage/b/{n.ENERGY_STATUS}": "complete",
            f"stage/a/{n.energy_source_tag('gpu1')}": "unknown",
            f"stage/b/{n.energy_source_tag('gpu1')}": "measured-nvml"}
    assert _combined(metrics, tags)["tags"][n.ENERGY_STATUS] == "partial"
