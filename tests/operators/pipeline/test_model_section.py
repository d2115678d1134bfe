"""``model.config_overrides`` and ``model.init_from``: spec checks, the committed key list
against the installed transformers, and the path into the trainer's job config."""

from __future__ import annotations

import pytest

from trainforge.engines.base import JobIdentity
from trainforge.jobconfig import render_job_config
from trainforge.pipeline import SpecError, parse_spec_text
from trainforge.pipeline.llama_keys import FIRST_CLASS, NOT_ARCHITECTURE, OVERRIDABLE
from tests.operators.pipeline.test_loader import MINIMAL

_PY_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "null": type(None)}


def test_committed_key_list_covers_llama_config_exactly():
    from transformers import LlamaConfig

    keys = set(LlamaConfig().to_dict())
    tables = [set(OVERRIDABLE), set(FIRST_CLASS), set(NOT_ARCHITECTURE)]
    assert set.union(*tables) == keys, (
        f"operators/pipeline/llama_keys.py is out of date with transformers' LlamaConfig: missing "
        f"{sorted(keys - set.union(*tables))}, gone {sorted(set.union(*tables) - keys)}")
    assert sum(len(t) for t in tables) == len(keys), "a key is in two tables"


@pytest.mark.parametrize("key", sorted(OVERRIDABLE))
def test_committed_types_match_llama_config_defaults(key):
    from transformers import LlamaConfig

    default = LlamaConfig().to_dict()[key]
    assert type(default) in {_PY_TYPES[t] for t in OVERRIDABLE[key]}, (key, default)


def test_trainer_applies_the_overrides_to_the_transformers_config():
    from trainforge.trainer.config import ModelConfig
    from trainforge.trainer.model import llama_config

    section = ModelConfig("llama", 64, 2, 4, 4, 128, 10_000.0, 0.0, True,
                          config_overrides={"rms_norm_eps": 1e-5, "attention_bias": True,
                                            "hidden_act": "gelu"})
    config = llama_config(section, vocab_size=300, eos_id=0, max_positions=32)
    assert (config.rms_norm_eps, config.attention_bias, config.hidden_act) == (1e-5, True, "gelu")


def test_trainer_refuses_a_first_class_key_even_when_the_spec_was_bypassed():
    from trainforge.trainer.config import ModelConfig
    from trainforge.trainer.errors import ConfigError
    from trainforge.trainer.model import llama_config

    section = ModelConfig("llama", 64, 2, 4, 4, 128, 10_000.0, 0.0, True,
                          config_overrides={"vocab_size": 10})
    with pytest.raises(ConfigError, match="model.config_overrides.vocab_size"):
        llama_config(section, vocab_size=300, eos_id=0, max_positions=32)


@pytest.mark.parametrize("model,path,line,fragment", [
    ("  config_overrides:\n    hidden_size: 512\n", "model.config_overrides.hidden_size", 17,
     "hidden_size is set by model.hidden_size"),
    ("  config_overrides:\n    rope_theta: 5e5\n", "model.config_overrides.rope_theta", 17,
     "set by model.rope_theta"),
    ("  config_overrides:\n    rms_norm_ep: 1e-5\n", "model.config_overrides.rms_norm_ep", 17,
     "did you mean 'rms_norm_eps'"),
    ("  config_overrides:\n    attention_bias: 1\n", "model.config_overrides.attention_bias", 17,
     "wrong type for attention_bias (got 1; expected bool)"),
    ("  config_overrides:\n    rms_norm_eps: [1]\n", "model.config_overrides.rms_norm_eps", 17,
     "got [1]"),
    ("  init_from: models:/tiny-llm\n", "model.init_from", 16, "not a registered model URI"),
    ("  init_from: models:/tiny-llm@champion\n", "data.tokenizer.source", 16,
     "expected 'models:/tiny-llm@champion'"),
])
def test_model_section_errors(model, path, line, fragment):
    with pytest.raises(SpecError) as info:
        parse_spec_text(MINIMAL + "model:\n" + model, "bad.yaml")
    match = [i for i in info.value.issues if i.path == path]
    assert match, [str(i) for i in info.value.issues]
    assert match[0].line == line and fragment in match[0].message, str(match[0])


def _spec(extra_model: str, tokenizer: str = ""):
    text = MINIMAL.replace("  sources: [corpus/*.txt]\n",
                           "  sources: [corpus/*.txt]\n" + tokenizer)
    return parse_spec_text(text + "model:\n" + extra_model, "ok.yaml")


IDENTITY = JobIdentity("tiny", "manual__1", "train", 1)


def test_overrides_and_init_reach_the_job_config_the_trainer_accepts():
    from trainforge.trainer.config import parse_job_config

    spec = _spec("  init_from: models:/tiny-llm@champion\n"
                 "  config_overrides: {rms_norm_eps: 1e-5, attention_bias: true}\n",
                 tokenizer="  tokenizer:\n    source: models:/tiny-llm@champion\n")
    config = render_job_config(spec, "/data/ds", "/ckpt", IDENTITY,
                               init={"checkpoint": "/models/tiny-llm/3", "source": "models:/tiny-llm/3"})
    assert config["model"]["config_overrides"] == {"attention_bias": True, "rms_norm_eps": 1e-5}
    assert config["init"] == {"checkpoint": "/models/tiny-llm/3", "source": "models:/tiny-llm/3"}
    parsed = parse_job_config(config)
    assert parsed.model.config_overrides == {"attention_bias": True, "rms_norm_eps": 1e-5}
    assert (parsed.init.checkpoint, parsed.init.source) == ("/models/tiny-llm/3", "models:/tiny-llm/3")


def test_a_spec_without_them_renders_the_same_job_config_as_before():
    config = render_job_config(_spec("  hidden_size: 256\n"), "/data/ds", "/ckpt", IDENTITY)
    assert "config_overrides" not in config["model"] and "init" not in config
