"""`trainforge run --engine`: the derived spec, and which Ray cluster a run uses."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from operators.cli import app
from operators.runner import derived_spec, ray_cluster, write_spec
from operators.spec import load_spec

SPEC = Path(__file__).resolve().parents[1] / "e2e" / "tiny_shakespeare.yaml"


def test_derived_spec_switches_the_engine_and_sets_the_ray_address(tmp_path):
    spec = load_spec(SPEC)
    ray = derived_spec(spec, "ray", "http://127.0.0.1:18265")
    assert ray.training.engine == "ray"
    assert ray.training.engine_block.address == "http://127.0.0.1:18265"
    assert ray.dag_id == spec.dag_id and ray.training.resources == spec.training.resources
    path = write_spec(ray, tmp_path / "specs" / "tiny.ray.yaml")
    assert load_spec(path) == ray
    assert not list(path.parent.glob(".*.tmp"))


def test_an_engine_the_spec_does_not_fit_is_refused_with_what_is_missing():
    with pytest.raises(ValueError, match="training.resources.image"):
        derived_spec(load_spec(SPEC), "kubernetes")


def test_run_rejects_an_unknown_engine_without_a_traceback():
    result = CliRunner().invoke(app, ["run", str(SPEC), "--engine", "raay"])
    assert result.exit_code == 1
    assert "unknown engine 'raay'" in result.output and "Traceback" not in result.output


@pytest.mark.integration
def test_a_ray_cluster_that_answers_is_used_and_none_is_started(ray_head, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", ray_head.address)
    env = {"RAY_API_SERVER_ADDRESS": ray_head.address}
    with contextlib.ExitStack() as stack:
        address = ray_cluster(derived_spec(load_spec(SPEC), "ray"), stack, Console(), env)
        assert address == ray_head.address
        assert not stack._exit_callbacks  # no head was started, nothing to stop
    assert env == {"RAY_API_SERVER_ADDRESS": ray_head.address}
