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


@pytest.mark.parametrize(("written", "rendered"), [(None, None), ("error", None), ("warn", "warn")])
def test_framework_compile_fallback_reaches_the_trainer(written, rendered):
    framework = "" if written is None else f"  framework:\n    compile_fallback: {written}\n"
    spec = parse_spec_text(MINIMAL.replace("  checkpoint:\n", framework + "  checkpoint:\n"), "ok.yaml")
    config = render_job_config(spec, "/data/ds", "/ckpt", IDENTITY)
    assert config["framework"].get("compile_fallback") == rendered  # the default: configs as before
    assert parse_job_config(config).framework.compile_fallback == (rendered or "error")


def test_an_unknown_compile_fallback_is_a_spec_error():
    with pytest.raises(SpecError) as info:
        parse_spec_text(MINIMAL.replace("  checkpoint:\n", "  framework:\n    compile_fallback: eager\n"
                                        "  checkpoint:\n"), "ok.yaml")
    issues = [str(i) for i in info.value.issues]
    assert [i.path for i in info.value.issues] == ["training.framework.compile_fallback"], issues
    assert "'error'" in issues[0] and "'warn'" in issues[0], issues


def test_a_stage_overrides_framework_compile_and_the_others_inherit_it():
    from trainforge.pipeline.stages import stage_spec

    text = (MINIMAL.replace("  checkpoint:\n", "  framework:\n    compile: true\n  checkpoint:\n")
            + "stages:\n  - name: a\n  - name: b\n    training:\n      framework: {compile: false}\n")
    spec = parse_spec_text(text, "ok.yaml")
    compiled = {name: render_job_config(stage_spec(spec, name), "/d", "/c", IDENTITY)["framework"]["compile"]
                for name in ("a", "b")}
    assert compiled == {"a": True, "b": False}


PRETRAINED = {"folder": "/models/qwen3", "source": "hf://Qwen/Qwen3-0.6B",
              "revision": "0123456789abcdef0123456789abcdef01234567"}


def _pretrained_spec(model: str):
    return parse_spec_text(MINIMAL + "model:\n  pretrained: hf://Qwen/Qwen3-0.6B\n" + model,
                           "ok.yaml")


def test_a_pretrained_spec_renders_the_reduced_model_section_and_the_source():
    config = render_job_config(_pretrained_spec(""), "/data/ds", "/ckpt", IDENTITY,
                               pretrained=PRETRAINED)
    assert config["model"] == {"family": "pretrained", "dropout": None}
    assert config["pretrained"] == PRETRAINED
    parsed = parse_job_config(config)
    assert (parsed.pretrained.source, parsed.pretrained.revision) == (
        PRETRAINED["source"], PRETRAINED["revision"])


def test_a_pretrained_spec_passes_its_dropouts_on():
    spec = _pretrained_spec("  dropout: 0.1\n  config_overrides: {hidden_dropout: 0.05}\n")
    config = render_job_config(spec, "/data/ds", "/ckpt", IDENTITY, pretrained=PRETRAINED)
    assert config["model"] == {"family": "pretrained", "dropout": 0.1,
                               "config_overrides": {"hidden_dropout": 0.05}}
    assert parse_job_config(config).model.dropout == 0.1


def test_the_pretrained_section_and_the_spec_must_agree():
    with pytest.raises(ValueError, match="pass its job_section"):
        render_job_config(_pretrained_spec(""), "/data/ds", "/ckpt", IDENTITY)
    with pytest.raises(ValueError, match="model.pretrained is None"):
        render_job_config(parse_spec_text(MINIMAL, "ok.yaml"), "/data/ds", "/ckpt", IDENTITY,
                          pretrained=PRETRAINED)


def test_training_peft_reaches_the_trainer_as_lora_settings():
    from trainforge.trainer.config import LoraSettings

    text = MINIMAL.replace("training:\n", "training:\n  peft: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}\n",
                           1)
    spec = parse_spec_text(text + "model:\n  pretrained: hf://Qwen/Qwen3-0.6B\n", "ok.yaml")
    config = render_job_config(spec, "/data/ds", "/ckpt", IDENTITY, pretrained=PRETRAINED)
    assert parse_job_config(config).peft == LoraSettings(r=8, alpha=16.0, dropout=0.05,
                                                         target_modules=("q_proj", "v_proj"), merge=True)
    auto = parse_spec_text(MINIMAL.replace("training:\n", "training:\n  peft: {}\n", 1)
                           + "model:\n  pretrained: hf://Qwen/Qwen3-0.6B\n", "ok.yaml")
    rendered = render_job_config(auto, "/data/ds", "/ckpt", IDENTITY, pretrained=PRETRAINED)
    assert parse_job_config(rendered).peft.target_modules is None  # auto: the family's projections
    assert "peft" not in render_job_config(_pretrained_spec(""), "/data/ds", "/ckpt", IDENTITY,
                                           pretrained=PRETRAINED)


def test_data_packing_reaches_the_trainer_and_is_absent_when_false():
    chat = MINIMAL.replace("  sources: [corpus/*.txt]\n", "  sources: [corpus/*.txt]\n  format: chat\n")
    packed = parse_spec_text(chat.replace("  format: chat\n", "  format: chat\n  packing: true\n")
                             + "model:\n  pretrained: hf://Qwen/Qwen3-0.6B\n", "ok.yaml")
    config = render_job_config(packed, "/data/ds", "/ckpt", IDENTITY, pretrained=PRETRAINED)
    assert config["data"]["packing"] is True and parse_job_config(config).data.packing is True
    padded = parse_spec_text(chat + "model:\n  pretrained: hf://Qwen/Qwen3-0.6B\n", "ok.yaml")
    config = render_job_config(padded, "/data/ds", "/ckpt", IDENTITY, pretrained=PRETRAINED)
    assert "packing" not in config["data"] and parse_job_config(config).data.packing is False


@pytest.mark.parametrize("peft,fragment", [
    ({"method": "lora", "r": 0, "alpha": 1, "dropout": 0, "merge": True}, "peft.r=0"),
    ({"method": "dora", "r": 4, "alpha": 1, "dropout": 0, "merge": True}, "peft.method='dora'"),
    ({"method": "lora", "r": 4, "alpha": 1, "dropout": 0, "merge": True, "target_modules": []},
     "peft.target_modules=[]"),
])
def test_a_bad_peft_section_is_refused_naming_the_field(peft, fragment):
    from trainforge.trainer.errors import ConfigError

    config = render_job_config(_pretrained_spec(""), "/data/ds", "/ckpt", IDENTITY, pretrained=PRETRAINED)
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        parse_job_config({**config, "peft": peft})
    plain = render_job_config(parse_spec_text(MINIMAL, "ok.yaml"), "/data/ds", "/ckpt", IDENTITY)
    with pytest.raises(ConfigError, match="peft section without a pretrained one"):
        parse_job_config({**plain, "peft": {"method": "lora", "r": 4, "alpha": 1, "dropout": 0, "merge": True}})
