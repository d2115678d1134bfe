"""The validate_checkpoint task's pure parts (validator command line, expected job config) and the
spec fields of the validation policy and the eval gate. No Airflow DB, no server."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from trainforge.pipeline.loader import load_spec
from trainforge.pipeline.spec import PipelineSpec
from trainforge.pipeline.registry import RegistrySection, ValidationSection
from trainforge.tasks.validate_checkpoint import expected_job_config, validator_argv

SPEC = Path(__file__).resolve().parents[2] / "e2e" / "tiny_shakespeare.yaml"


def _spec(**validation) -> PipelineSpec:
    raw = load_spec(SPEC).model_dump(mode="json")
    raw["validation"].update(validation)
    return PipelineSpec.model_validate(raw)


def _options(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_validator_argv_newest_pins_the_final_step():
    argv = validator_argv("/py", _spec(), "/ck", "/ds", "/r.json", "/e.json", 200, 1024)
    assert argv[:3] == ["/py", "-m", "trainforge.trainer.validate"]
    pairs = _options(argv)
    assert pairs["--policy"] == "newest" and pairs["--step"] == "200"
    assert pairs["--expect-job-config"] == "/e.json" and pairs["--expect-vocab-size"] == "1024"
    assert pairs["--expect-world-size"] == "2" and "--quarantine" in argv


def test_validator_argv_best_val_loss_lets_the_validator_choose():
    argv = validator_argv("/py", _spec(policy="best_val_loss"), "/ck", "/ds", "/r", "/e", 200, None)
    assert "--step" not in argv and "--expect-vocab-size" not in argv
    assert argv[argv.index("--policy") + 1] == "best_val_loss"


def test_expected_job_config_has_the_train_tasks_digest():
    from trainforge.engines.base import JobIdentity
    from trainforge.jobconfig import render_job_config
    from trainforge.trainer.expectations import config_digest

    spec = _spec()
    expected = expected_job_config(spec, "/ds", "/ck", "dag", "run", "train")
    launched = render_job_config(spec, "/ds", "/ck", JobIdentity("dag", "run", "train", 3))
    assert config_digest(expected) == config_digest(launched)  # identity (try number) left out
    assert expected["checkpoint"]["dir"] == "/ck" and expected["data"]["dataset_dir"] == "/ds"


def test_validation_section_defaults():
    v = ValidationSection()
    assert v.policy == "newest"
    assert (v.gate.enabled, v.gate.metric, v.gate.min_improvement) == (True, "val_bits_per_byte", 0.0)


@pytest.mark.parametrize(("section", "data", "fragment"), [
    (ValidationSection, {"policy": "oldest"}, "'newest' or 'best_val_loss'"),
    (ValidationSection, {"gate": {"metric": "accuracy"}}, "gate.metric"),
    (ValidationSection, {"gate": {"min_improvement": 1.5}}, "less than 1"),
    (ValidationSection, {"gate": {"min_improvement": -0.1}}, "greater than or equal to 0"),
    (ValidationSection, {"gate": {"enable": True}}, "Extra inputs are not permitted"),
    (RegistrySection, {"model_name": "m", "aliases": ["challenger", "champion"]},
     "'champion' is moved only by the eval gate"),
])
def test_spec_errors(section, data, fragment):
    with pytest.raises(ValidationError) as err:
        section.model_validate(data)
    assert fragment in str(err.value)
