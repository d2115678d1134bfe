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


@pytest.mark.parametrize(("written", "rendered"), [
    (None, "auto"),  # not written: the default
    ("auto", "auto"),
    ("true", True),
    ("false", False),
    ("yes", True),  # a YAML 1.1 boolean, like every other boolean field of the spec
])
def test_framework_compile_reaches_the_trainer(written, rendered):
    framework = "" if written is None else f"  framework:\n    compile: {written}\n"
    spec = parse_spec_text(MINIMAL.replace("  checkpoint:\n", framework + "  checkpoint:\n"), "ok.yaml")
    config = render_job_config(spec, "/data/ds", "/ckpt", IDENTITY)
    compile_ = config["framework"]["compile"]
    assert compile_ == rendered and type(compile_) is type(rendered)  # True, not 1 or "true"
    assert parse_job_config(config).framework.compile == rendered


def test_a_stage_overrides_framework_compile_and_the_others_inherit_it():
    from trainforge.pipeline.stages import stage_spec

    text = (MINIMAL.replace("  checkpoint:\n", "  framework:\n    compile: true\n  checkpoint:\n")
            + "stages:\n  - name: a\n  - name: b\n    training:\n      framework: {compile: false}\n")
    spec = parse_spec_text(text, "ok.yaml")
    compiled = {name: render_job_config(stage_spec(spec, name), "/d", "/c", IDENTITY)["framework"]["compile"]
                for name in ("a", "b")}
    assert compiled == {"a": True, "b": False}
