"""trainforge.jobconfig: spec policies the trainer enforces reach the job config it accepts."""

from __future__ import annotations

import pytest

from trainforge.engines.base import JobIdentity
from trainforge.jobconfig import render_job_config
from trainforge.pipeline import SpecError, parse_spec_text
from trainforge.trainer.config import parse_job_config
from tests.operators.pipeline.test_loader import MINIMAL

IDENTITY = JobIdentity("tiny", "manual__1", "train", 1)


def _spec(fault: str):
    text = MINIMAL.replace("  checkpoint:\n", f"  fault:\n{fault}  checkpoint:\n")
    return parse_spec_text(text, "ok.yaml")


def test_world_size_change_refuse_reaches_the_trainer():
    config = render_job_config(_spec("    world_size_change: refuse\n"), "/data/ds", "/ckpt",
                               IDENTITY)
    assert config["distributed"]["world_size_change"] == "refuse"
    assert parse_job_config(config).distributed.world_size_change == "refuse"


def test_the_default_continue_leaves_the_job_config_as_before():
    spec = parse_spec_text(MINIMAL, "ok.yaml")
    assert spec.training.fault.world_size_change == "continue"
    config = render_job_config(spec, "/data/ds", "/ckpt", IDENTITY)
    assert "world_size_change" not in config["distributed"]
    assert parse_job_config(config).distributed.world_size_change == "continue"


def test_an_unknown_world_size_change_is_a_spec_error():
    with pytest.raises(SpecError) as info:
        _spec("    world_size_change: reshard\n")
    assert any(i.path == "training.fault.world_size_change" for i in info.value.issues), \
        [str(i) for i in info.value.issues]
