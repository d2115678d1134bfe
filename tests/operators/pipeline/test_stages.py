"""Training stages in the spec: merged sections, graph order, and one row per kind of mistake."""

from __future__ import annotations

import pytest

from trainforge.pipeline import SpecError, parse_spec_text, validate_overrides
from trainforge.pipeline.spec import PipelineSpec
from trainforge.pipeline.stages import leaf_stages, resolve_stages, stage_folder, stage_spec

BASE = """\
pipeline:
  name: staged
data:
  sources: [corpus/*.txt]
training:
  optimization:
    max_steps: 10
    global_batch_size: 4
    micro_batch_size: 2
    learning_rate: 1e-3
  checkpoint:
    interval_steps: 5
registry:
  model_name: staged-llm
"""

CHAIN = BASE + """\
stages:
  - name: pretrain
    training:
      optimization:
        max_steps: 20
  - name: finetune
    depends_on: [pretrain]
    init_from: pretrain
    training:
      optimization:
        learning_rate: 1e-4
        warmup_steps: 2
      fault:
        run_timeout: 30m
"""

SWEEP = BASE + """\
stages:
  - name: lr_high
    training:
      optimization: {learning_rate: 3e-3}
  - name: lr_low
    training:
      optimization: {learning_rate: 3e-4}
"""


def test_a_stage_inherits_the_top_level_training_and_overrides_what_it_names():
    spec = parse_spec_text(CHAIN, "chain.yaml")
    pretrain, finetune = resolve_stages(spec)
    assert (pretrain.task_id, finetune.task_id) == ("train_pretrain", "train_finetune")
    assert pretrain.training.optimization.max_steps == 20
    assert pretrain.training.optimization.learning_rate == pytest.approx(1e-3)  # inherited
    assert finetune.training.optimization.max_steps == 10  # top level, not pretrain's
    assert finetune.training.optimization.learning_rate == pytest.approx(1e-4)
    assert finetune.training.optimization.warmup_steps == 2
    assert finetune.training.fault.run_timeout == 1800
    assert finetune.training.checkpoint.interval_steps == 5
    assert (finetune.depends_on, finetune.init_from, finetune.init_task_id) == (
        ("pretrain",), "pretrain", "train_pretrain")
    assert [s.name for s in leaf_stages([pretrain, finetune])] == ["finetune"]
    assert stage_spec(spec, "finetune").training == finetune.training
    with pytest.raises(KeyError, match="no stage named 'nope'"):
        stage_spec(spec, "nope")


def test_stages_run_after_what_they_depend_on_whatever_the_declaration_order():
    text = CHAIN.replace("  - name: pretrain\n", "  - name: zz_later\n    depends_on: [finetune]\n"
                         "  - name: pretrain\n", 1)
    spec = parse_spec_text(text, "order.yaml")
    assert [s.name for s in resolve_stages(spec)] == ["pretrain", "finetune", "zz_later"]
    assert [s.name for s in leaf_stages(resolve_stages(spec))] == ["zz_later"]


def test_booleans_and_durations_override_like_any_other_field():
    text = _stages("  - name: ft\n    training:\n      framework: {activation_checkpointing: true}\n"
                   "      fault: {cancel_on_kill: false, poll_interval: 2s}\n")
    (ft,) = resolve_stages(parse_spec_text(text, "b.yaml"))
    assert ft.training.framework.activation_checkpointing is True
    assert (ft.training.fault.cancel_on_kill, ft.training.fault.poll_interval) == (False, 2)


def test_a_sweep_has_every_variant_as_a_leaf():
    spec = parse_spec_text(SWEEP, "sweep.yaml")
    stages = resolve_stages(spec)
    assert [s.name for s in leaf_stages(stages)] == ["lr_high", "lr_low"]
    assert [s.training.optimization.learning_rate for s in stages] == pytest.approx([3e-3, 3e-4])


def test_without_stages_there_is_one_train_task():
    spec = parse_spec_text(BASE, "one.yaml")
    (only,) = resolve_stages(spec)
    assert (only.name, only.task_id, only.training) == (None, "train", spec.training)
    assert stage_spec(spec, None) is spec


def test_a_dumped_spec_carries_only_the_overrides_and_reloads_equal():
    spec = parse_spec_text(CHAIN, "chain.yaml")
    dumped = spec.model_dump(mode="json")["stages"]
    assert dumped[1]["training"] == {
        "optimization": {"learning_rate": 1e-4, "warmup_steps": 2}, "fault": {"run_timeout": "30m"}}
    assert PipelineSpec.model_validate(spec.model_dump(mode="json")) == spec


def test_trigger_params_change_the_top_level_training_that_stages_inherit():
    spec = parse_spec_text(CHAIN, "chain.yaml")
    changed = validate_overrides(spec, {"training.optimization.learning_rate": 5e-3,
                                        "training.optimization.max_steps": 30})
    pretrain, finetune = resolve_stages(changed)
    assert pretrain.training.optimization.learning_rate == pytest.approx(5e-3)
    assert pretrain.training.optimization.max_steps == 20  # the stage sets it itself
    assert finetune.training.optimization.learning_rate == pytest.approx(1e-4)
    assert finetune.training.optimization.max_steps == 30


def test_stage_folders_nest_under_the_run_folder_locally_and_on_s3():
    assert stage_folder("/ck/dag/run", "pretrain") == "/ck/dag/run/pretrain"
    assert stage_folder("s3://bucket/ck/dag/run/", "ft") == "s3://bucket/ck/dag/run/ft"
    assert stage_folder("/ck/dag/run", None) == "/ck/dag/run"


def _lines(text: str, needle: str) -> int:
    """1-based line of the first line containing ``needle``."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def _stages(block: str) -> str:
    return BASE + "stages:\n" + block


UNKNOWN_DEP = _stages("  - name: pretrain\n  - name: finetune\n    depends_on: [pretrian]\n")
UNKNOWN_INIT = _stages("  - name: pretrain\n  - name: finetune\n    depends_on: [pretrain]\n"
                       "    init_from: pretrian\n")
INIT_NOT_DEP = _stages("  - name: pretrain\n  - name: other\n  - name: finetune\n"
                       "    depends_on: [other]\n    init_from: pretrain\n")
CYCLE = _stages("  - name: a\n    depends_on: [c]\n  - name: b\n    depends_on: [a]\n"
                "  - name: c\n    depends_on: [b]\n")
SELF_CYCLE = _stages("  - name: a\n    depends_on: [a]\n")
DUPLICATE = _stages("  - name: sweep\n  - name: sweep\n")
BAD_VALUE = _stages("  - name: ft\n    training:\n      optimization:\n"
                    "        learning_rate: fast\n")
MISSPELT = _stages("  - name: ft\n    training:\n      optimization:\n"
                   "        learnin_rate: 1e-4\n")
MERGED_RULE = _stages("  - name: ft\n    training:\n      optimization:\n"
                      "        micro_batch_size: 3\n")
MERGED_INTERVAL = _stages("  - name: ft\n    training:\n      optimization:\n"
                          "        max_steps: 3\n")
BAD_NAME = _stages("  - name: Fine Tune\n")
BAD_ENGINE = _stages("  - name: ft\n    training:\n      engine: kubernets\n")
K8S_LOCAL_DISK = _stages("  - name: ft\n    training:\n      engine: kubernetes\n"
                         "      resources: {image: 'registry.example.com/t:1'}\n")
UNKNOWN_KEY = _stages("  - name: ft\n    depend_on: [x]\n")
EMPTY = BASE + "stages: []\n"
BOOL_STEPS = _stages("  - name: ft\n    training:\n      optimization:\n        max_steps: yes\n")

# (yaml text, field path, line, message fragment) — one row per kind of mistake.
CASES = [
    (UNKNOWN_DEP, "stages.1.depends_on.0", _lines(UNKNOWN_DEP, "pretrian"),
     "unknown stage (got 'pretrian'; expected one of: pretrain; did you mean 'pretrain'?)"),
    (UNKNOWN_INIT, "stages.1.init_from", _lines(UNKNOWN_INIT, "init_from"),
     "did you mean 'pretrain'?"),
    (INIT_NOT_DEP, "stages.2.init_from", _lines(INIT_NOT_DEP, "init_from"),
     "init_from must be one of this stage's depends_on (got 'pretrain'"),
    (CYCLE, "stages.0.depends_on.0", _lines(CYCLE, "depends_on: [c]"),
     "dependency cycle (got a -> c -> b -> a"),
    (SELF_CYCLE, "stages.0.depends_on.0", _lines(SELF_CYCLE, "depends_on: [a]"),
     "dependency cycle (got a -> a"),
    (DUPLICATE, "stages.1.name", _lines(DUPLICATE, "name: sweep") + 1,
     "duplicate stage name (got 'sweep'; already the name of stages[0]"),
    (BAD_VALUE, "stages.0.training.optimization.learning_rate", _lines(BAD_VALUE, "fast"),
     "got 'fast'"),
    (MISSPELT, "stages.0.training.optimization.learnin_rate", _lines(MISSPELT, "learnin_rate"),
     "did you mean 'learning_rate'?"),
    (MERGED_RULE, "stages.0.training.optimization.global_batch_size",
     _lines(MERGED_RULE, "      optimization:"),
     "divisible by micro_batch_size x world size (got 4; 3 x 2 = 6)"),
    (MERGED_INTERVAL, "stages.0.training.checkpoint.interval_steps",
     _lines(MERGED_INTERVAL, "    training:"), "must fit in optimization.max_steps (got 5 > 3)"),
    (BAD_NAME, "stages.0.name", _lines(BAD_NAME, "Fine Tune"),
     "not a valid stage name (got 'Fine Tune'; expected lowercase"),
    (BAD_ENGINE, "stages.0.training.engine", _lines(BAD_ENGINE, "kubernets"),
     "did you mean 'kubernetes'?"),
    (K8S_LOCAL_DISK, "stages.0.training.engine", _lines(K8S_LOCAL_DISK, "engine: kubernetes"),
     "data.output_uri must be an s3:// URI for a stage on the kubernetes engine"),
    (UNKNOWN_KEY, "stages.0.depend_on", _lines(UNKNOWN_KEY, "depend_on"),
     "did you mean 'depends_on'?"),
    (EMPTY, "stages", _lines(EMPTY, "stages"), "at least 1 item"),
    (BOOL_STEPS, "stages.0.training.optimization.max_steps", _lines(BOOL_STEPS, "yes"),
     "expected a number, not a boolean"),
]


@pytest.mark.parametrize("text,path,line,fragment", CASES)
def test_invalid_stages_point_at_the_field_and_line(text, path, line, fragment):
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    match = [i for i in info.value.issues if i.path == path]
    assert match, f"no issue at {path!r}: {[str(i) for i in info.value.issues]}"
    assert match[0].line == line, str(match[0])
    assert fragment in match[0].message, str(match[0])
    assert str(match[0]).startswith(f"bad.yaml:{line}:")


def test_every_stage_mistake_of_a_file_is_reported_at_once():
    text = _stages("  - name: ft\n    depends_on: [pretrian]\n    training:\n"
                   "      optimization: {learning_rate: fast}\n  - name: ft\n")
    text = text.replace("model_name: staged-llm", "model_name: no")  # an error outside stages
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    paths = {i.path for i in info.value.issues}
    assert {"stages.0.depends_on.0", "stages.0.training.optimization.learning_rate",
            "stages.1.name", "registry.model_name"} <= paths, paths


def test_a_broken_top_level_training_is_reported_once_not_per_stage():
    text = CHAIN.replace("    learning_rate: 1e-3\n", "    learning_rate: 0\n", 1)
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    assert [i.path for i in info.value.issues] == ["training.optimization.learning_rate"]


def test_the_published_schema_accepts_stages_and_checks_their_overrides():
    import jsonschema
    import yaml

    from trainforge.pipeline.schema import json_schema

    def load(text: str):  # plain YAML 1.1 reads 1e-3 as text; editors see what users write
        return yaml.safe_load(text.replace("1e-3", "0.001").replace("1e-4", "0.0001"))

    validator = jsonschema.Draft202012Validator(json_schema())
    assert not list(validator.iter_errors(load(CHAIN)))
    bad = load(MISSPELT)
    errors = list(validator.iter_errors(bad))
    assert any("learnin_rate" in e.message for e in errors), [e.message for e in errors]
