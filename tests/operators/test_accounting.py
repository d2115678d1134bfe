"""Accounting of a launch from its wall time and the spec's resources and prices."""

from pathlib import Path

import pytest

from trainforge.accounting import account
from trainforge.pipeline import load_spec, validate_overrides

DEMO = Path(__file__).resolve().parents[2] / "dags" / "pipelines" / "shakespeare_llm.yaml"


def test_cpu_run_counts_core_hours_and_energy():
    spec = validate_overrides(load_spec(DEMO), {"cost.cpu_hour_price": 0.05})
    usage = account(spec, 1800)  # 2 ranks x 1 core for half an hour
    assert usage["gpu_hours"] == 0
    assert usage["cpu_core_hours"] == pytest.approx(1.0)
    assert usage["cost"] == pytest.approx(0.05)
    assert usage["energy_kwh"] == pytest.approx(0.010)


def test_gpu_run_counts_gpu_hours_cost_and_energy():
    spec = validate_overrides(load_spec(DEMO), {
        "training.resources.gpus_per_node": 2, "cost.gpu_hour_price": 3.0,
        "cost.gpu_power_watts": 500.0, "cost.cpu_core_power_watts": 0.0})
    usage = account(spec, 7200)
    assert usage["gpu_hours"] == pytest.approx(4.0)
    assert usage["cost"] == pytest.approx(12.0)
    assert usage["energy_kwh"] == pytest.approx(2.0)
