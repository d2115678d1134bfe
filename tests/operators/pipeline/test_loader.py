"""Spec loading: valid files, and one row per kind of mistake (error type, field, line, text)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainforge.pipeline import SpecError, load_spec, parse_spec_text, validate_overrides

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"

MINIMAL = """\
pipeline:
  name: tiny
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
  model_name: tiny-llm
"""


def test_demo_spec_is_valid():
    spec = load_spec(DEMO)
    assert spec.dag_id == "shakespeare_llm"
    assert spec.training.world_size == 2
    assert spec.training.optimization.learning_rate == pytest.approx(3e-3)


def test_minimal_spec_takes_documented_defaults():
    spec = parse_spec_text(MINIMAL, "tiny.yaml")
    assert spec.training.optimization.learning_rate == pytest.approx(1e-3)
    assert isinstance(spec.training.optimization.learning_rate, float)
    assert spec.training.fault.run_timeout == 6 * 3600
    assert spec.registry.aliases == ["challenger"]
    assert spec.model.resolved_intermediate_size == 704  # 8/3 * 256 rounded up to 64


def _replace(old: str, new: str) -> str:
    assert old in MINIMAL
    return MINIMAL.replace(old, new)


def _under(section_line: str, extra: str) -> str:
    """Insert ``extra`` (already indented) right after the line ``section_line``."""
    assert section_line in MINIMAL
    return MINIMAL.replace(section_line, section_line + extra, 1)


# (yaml text, field path, line, message fragment) — one row per kind of mistake.
CASES = [
    # unknown keys, with a did-you-mean
    (_replace("learning_rate: 1e-3", "learnin_rate: 1e-3"),
     "training.optimization.learnin_rate", 10, "did you mean 'learning_rate'"),
    (_replace("  optimization:", "  optimisation:"), "training.optimisation", 6,
     "did you mean 'optimization'"),
    (_under("pipeline:\n", "  nmae: x\n"), "pipeline.nmae", 2, "did you mean 'name'"),
    (_replace("registry:", "registy:"), "registy", 13, "did you mean 'registry'"),
    # wrong types and values
    (_replace("learning_rate: 1e-3", "learning_rate: fast"),
     "training.optimization.learning_rate", 10, "got 'fast'"),
    (_replace("max_steps: 10", "max_steps: 0"), "training.optimization.max_steps", 7,
     "greater than or equal to 1"),
    (_replace("max_steps: 10", "max_steps: 10.5"), "training.optimization.max_steps", 7,
     "got 10.5"),
    (_replace("max_steps: 10", "max_steps: [10]"), "training.optimization.max_steps", 7,
     "valid integer"),
    (_replace("sources: [corpus/*.txt]", "sources: []"), "data.sources", 4, "at least 1 item"),
    (_replace("sources: [corpus/*.txt]", "sources: corpus/*.txt"), "data.sources", 4,
     "valid list"),
    (_under("data:\n", "  validation_fraction: 0.7\n"), "data.validation_fraction", 4,
     "less than 0.5"),
    (_under("training:\n", "  engine: kubernets\n"), "training.engine", 6, "unknown value"),
    (_under("training:\n", "  framework:\n    precision: fp4\n"),
     "training.framework.precision", 7, "expected 'fp32', 'bf16', 'fp16' or 'fp8'"),
    (_under("training:\n", "  framework:\n    parallelism: fsdp\n    gradient_compression: powersgd\n"),
     "training.framework.gradient_compression", 8, "does not apply to FSDP"),
    # framework.compile: 'auto', true or false, nothing lax pydantic would turn into a boolean
    (_under("training:\n", "  framework:\n    compile: yes-please\n"), "training.framework.compile", 7,
     "unknown value (got 'yes-please'; expected 'auto', true or false)"),
    (_under("training:\n", "  framework:\n    compile: 'true'\n"), "training.framework.compile", 7,
     "a quoted boolean is text; write true without quotes (got 'true'; expected 'auto', true or false)"),
    (_under("training:\n", "  framework:\n    compile: 1\n"), "training.framework.compile", 7,
     "(got 1; expected 'auto', true or false)"),
    (_under("training:\n", "  framework:\n    compile: Auto\n"), "training.framework.compile", 7,
     "expected 'auto', true or false; did you mean 'auto'?"),
    (MINIMAL + "stages:\n  - name: a\n    training:\n      framework: {compile: sometimes}\n",
     "stages.0.training.framework.compile", 18, "(got 'sometimes'; expected 'auto', true or false)"),
    (_under("training:\n", "  resources:\n    nodes: 2\n"), "training.resources.nodes", 7,
     "the local engine runs one torchrun group on one machine"),
    # a cross-field error about a field left at its default points at the field that clashes
    (_under("training:\n", "  resources:\n    gpus_per_node: 4\n"),
     "training.resources.processes_per_node", 7, "processes_per_node must equal gpus_per_node"),
    # durations
    (_under("pipeline:\n", "  defaults:\n    retry_delay: 30\n"),
     "pipeline.defaults.retry_delay", 3, "got 30"),
    (_under("pipeline:\n", "  defaults:\n    retry_delay: 5 minutes\n"),
     "pipeline.defaults.retry_delay", 3, "not a duration"),
    (_under("pipeline:\n", "  tasks:\n    train:\n      execution_timeout: 30m1h\n"),
     "pipeline.tasks.train.execution_timeout", 4, "largest first"),
    (_under("pipeline:\n", "  tasks:\n    trian:\n      retries: 2\n"),
     "pipeline.tasks.trian", 3, "did you mean 'train'"),
    # schedules: never a silent fallback
    (_under("pipeline:\n", "  schedule: every monday\n"), "pipeline.schedule", 2,
     "not a valid cron expression"),
    (_under("pipeline:\n", "  schedule: '@fortnightly'\n"), "pipeline.schedule", 2,
     "unknown schedule preset"),
    (_under("pipeline:\n", "  schedule: '61 * * * *'\n"), "pipeline.schedule", 2,
     "not a valid cron expression"),
    (_under("pipeline:\n", "  schedule:\n    assets: [corpus]\n"),
     "pipeline.schedule.assets", 3, "not an asset URI"),
    (_replace("name: tiny", "name: tiny llm"), "pipeline.name", 2, "not a valid dag_id"),
    # cross-field rules
    (_replace("global_batch_size: 4", "global_batch_size: 6"),
     "training.optimization.global_batch_size", 8, "divisible by micro_batch_size x world size"),
    (_replace("interval_steps: 5", "interval_steps: 50"),
     "training.checkpoint.interval_steps", 12, "must fit in optimization.max_steps"),
    (_replace("micro_batch_size: 2", "micro_batch_size: 8"),
     "training.optimization.micro_batch_size", 9, "may not exceed global_batch_size"),
    (_under("    max_steps: 10\n", "    warmup_steps: 10\n"),
     "training.optimization.warmup_steps", 8, "warmup_steps must be below max_steps"),
    (_under("training:\n", "  fault:\n    run_timeout: 1s\n    poll_interval: 1h\n"),
     "training.fault.poll_interval", 8, "poll_interval must be shorter than run_timeout "
     "(got 3600 s >= 1 s)"),
    (_replace("max_steps: 10", "max_steps: 99999999999999999999"),
     "training.optimization.max_steps", 7, "less than or equal to 1000000000"),
    (_under("training:\n", "  fault:\n    run_timeout: 99999999999999999999h\n"),
     "training.fault.run_timeout", 7, "a duration may be at most 366d (got "
     "'99999999999999999999h')"),
    (_under("training:\n", "  resources:\n    memory_gib: .inf\n"),
     "training.resources.memory_gib", 7, "Input should be a finite number"),
    (_replace("learning_rate: 1e-3", "learning_rate: .nan"),
     "training.optimization.learning_rate", 10, "Input should be a finite number"),
    (_under("    max_steps: 10\n", "    seed: 99999999999999999999\n"),
     "training.optimization.seed", 8, "less than or equal to 9223372036854775807"),
    (_under("training:\n", "  ray:\n    address: http://head:8265\n"), "training.ray", 6,
     "the 'ray' block configures engine 'ray', but engine is 'local'"),
    (_under("training:\n", "  engine: kubernetes\n"), "training.resources.image", 6,
     "the kubernetes engine needs resources.image"),
    (_under("training:\n", "  engine: kubernetes\n  resources:\n    image: trainer:1\n"),
     "data.output_uri", 6, "must be an s3:// URI with the kubernetes engine"),
    (MINIMAL + "model:\n  hidden_size: 256\n  num_heads: 3\n", "model.num_heads", 17,
     "must be divisible by num_heads="),
    (_under("data:\n", "  cleaning:\n    min_document_chars: 50\n    max_document_chars: 10\n"),
     "data.cleaning.max_document_chars", 6, "must be >= min_document_chars"),
    (_under("pipeline:\n", "  notifications:\n    email:\n      to: [ops]\n"),
     "pipeline.notifications.email.to", 4, "not an email address"),
    (_replace("  checkpoint:\n    interval_steps: 5\n",
              "  checkpoint:\n    interval_steps: 5\n    keep_last: 0\n"),
     "training.checkpoint.keep_last", 13, "greater than or equal to 1"),
    (_replace("model_name: tiny-llm", "model_name: tiny-llm\n  aliases: [latest]"),
     "registry.aliases", 15, "not a valid MLflow alias"),
    (_replace("registry:\n  model_name: tiny-llm\n", ""), "registry", 1,
     "required field is missing"),
    # YAML pitfalls
    (_replace("  name: tiny\n", "  name: tiny\n  name: other\n"), "pipeline.name", 3,
     "duplicate key"),
    (_replace("  name: tiny\n", "  name: tiny\n\tdescription: x\n"), "pipeline", 3, "tabs"),
    (_replace("model_name: tiny-llm", "model_name: no"), "registry.model_name", 14,
     "YAML reads unquoted 'no' as the boolean False"),
    (_under("pipeline:\n", "  owner: 1.10\n"), "pipeline.owner", 2,
     "read the unquoted '1.10' as float"),
    # a YAML boolean is never a number (lax pydantic would make `yes` one retry)
    (_under("pipeline:\n", "  defaults:\n    retries: yes\n"), "pipeline.defaults.retries", 3,
     "expected a number, not a boolean (got True); YAML reads unquoted 'yes' as the boolean"),
    (_under("pipeline:\n", "  tasks:\n    train:\n      retries: off\n"),
     "pipeline.tasks.train.retries", 4, "YAML reads unquoted 'off' as the boolean False"),
    (_under("pipeline:\n", "  catchup: 1\n"), "pipeline.catchup", 2,
     "expected true or false (got 1)"),
    (_under("pipeline:\n", "  catchup: 'true'\n"), "pipeline.catchup", 2,
     "a quoted boolean is text; write true without quotes (got 'true'; expected true or false)"),
    (_replace("learning_rate: 1e-3", "learning_rate: on"),
     "training.optimization.learning_rate", 10, "expected a number, not a boolean"),
    (_under("pipeline:\n", "  start_date: 2026/01/01\n"), "pipeline.start_date", 2,
     "not a valid date (got '2026/01/01'; expected YYYY-MM-DD)"),
    # a tab in the indentation is named as such, at the tab
    (_replace("    max_steps: 10\n", "\tmax_steps: 10\n"), "training.optimization", 7,
     "a tab is used for indentation; YAML indents with spaces, not tabs (got a tab at column 1"),
    (_replace("    max_steps: 10\n", "  \tmax_steps: 10\n"), "training.optimization", 7,
     "got a tab at column 3"),
    (_replace("    max_steps: 10\n", "    max_steps: 10\n\t\n"), "training.optimization", 8,
     "got a tab at column 1"),
    # keys YAML reads as something else than text: the field is named as written
    (_under("pipeline:\n", "  notifications:\n    email:\n      to: [ops@example.org]\n"
            "      on: [failure]\n"), "pipeline.notifications.email.on", 5,
     "key 'on' is read by YAML as the boolean True (got True; expected a text key: quote it"),
    (_under("training:\n", "  engine: kubernetes\n  kubernetes:\n    node_selector: {1: gpu}\n"),
     "training.kubernetes.node_selector.1", 8, "key '1' is read by YAML as the int 1"),
    # one line per value, in the got/expected form, whatever pydantic's union or model type says
    (MINIMAL + "model:\n  config_overrides: {rope_scaling: {type: linear, factor: 2.0}}\n",
     "model.config_overrides.rope_scaling", 16,
     "wrong kind of value (got a mapping; expected a number, string or boolean)"),
    (_under("training:\n", "  slurm:\n    partition: gpu\n"), "training.slurm", 6,
     "(got a slurm block; expected engine: slurm, or no slurm block)"),
    # a node range is a setting of its own, refused by an engine that runs one machine
    (_under("training:\n", "  resources:\n    nodes: {min: 1, max: 2}\n"),
     "training.resources.nodes", 7, "(got resources.nodes {min: 1, max: 2}; expected 1;"),
    (MINIMAL + "stages:\n  - name: a\n    training:\n      kubernetes:\n        namespace: ml\n",
     "stages.0.training.kubernetes", 18, "(got a kubernetes block; expected engine: kubernetes"),
    (MINIMAL.split("  optimization:")[0] + "validation:\n  eval_tokens: 4096\n"
     "registry:\n  model_name: tiny-llm\n", "training", 5,
     "the section is empty (got null; expected a mapping of training settings)"),
    # one error does not hide an independent one
    (_under("training:\n", "  engine: kubernetes\n"), "data.output_uri", 6,
     "must be an s3:// URI with the kubernetes engine"),
    (_under("training:\n", "  slurm:\n    partition: gpu\n").replace("learning_rate", "learnin_rate"),
     "training.slurm", 6, "the 'slurm' block configures engine 'slurm', but engine is 'local'"),
    (MINIMAL + "stages:\n  - name: a\n    training:\n      optimization:\n"
     "        learnin_rate: 1e-3\n        micro_batch_size: 3\n",
     "stages.0.training.optimization.global_batch_size", 18,
     "divisible by micro_batch_size x world size (got 4; 3 x 2 = 6)"),
    (MINIMAL + "model:\n  hidden_size: 250\n  num_heads: 4\n  num_kv_heads: 3\n",
     "model.num_kv_heads", 18, "must be a multiple of num_kv_heads="),
    # a quoted number is text, as the JSON Schema says
    (_replace("max_steps: 10", 'max_steps: "10"'), "training.optimization.max_steps", 7,
     "a quoted number is text; write 10 without quotes (got '10'; expected a number)"),
    (_replace("learning_rate: 1e-3", "learning_rate: '1e-3'"),
     "training.optimization.learning_rate", 10, "write 1e-3 without quotes"),
    (MINIMAL + "stages:\n  - name: a\n    training:\n      optimization:\n"
     "        max_steps: '8'\n", "stages.0.training.optimization.max_steps", 19,
     "a quoted number is text; write 8 without quotes"),
    # an unquoted value that starts with '*' is an alias to YAML: say so, with the quoted form
    (_under("pipeline:\n", "  schedule: */5 * * * *\n"), "pipeline.schedule", 2,
     "YAML reads a value that starts with '*' as an alias (*name) (got */5 * * * *; expected "
     "text in quotes: schedule: '*/5 * * * *')"),
    (_under("pipeline:\n", "  schedule: * * * * 1  # weekly\n"), "pipeline.schedule", 2,
     "expected text in quotes: schedule: '* * * * 1'"),
    (_replace("sources: [corpus/*.txt]", "sources: [*.txt]"), "data.sources", 4,
     "(got *.txt; expected text in quotes: '*.txt')"),
    (_under("pipeline:\n", "  schedule: *weekly\n"), "pipeline.schedule", 2,
     "expected text in quotes: schedule: '*weekly'"),
    # keys written in the wrong section: one line each, naming where they belong
    ("name: tiny\n" + MINIMAL.replace("  name: tiny\n", ""), "name", 1,
     "unknown field at the top level (got 'name'; did you mean pipeline.name? move it under "
     "pipeline:)"),
    (_under("training:\n", "  max_steps: 10\n").replace("    max_steps: 10\n", ""),
     "training.max_steps", 6,
     "unknown field in training (got 'max_steps'; did you mean training.optimization.max_steps? "
     "move it under training.optimization:)"),
    (MINIMAL + "stages:\n  - name: a\n    training:\n      max_steps: 8\n",
     "stages.0.training.max_steps", 18, "did you mean stages.0.training.optimization.max_steps?"),
    (_under("  optimization:\n", "    engine: ray\n"), "training.optimization.engine", 7,
     "did you mean training.engine? move it under training:"),
    # a key already written where it belongs is no misplaced copy of it: the plain error
    (_replace("  model_name: tiny-llm\n", "  model_name: tiny-llm\n  name: x\n"),
     "registry.name", 15, "unknown field (got 'name'; expected one of: aliases, approval, eval, model_name, tags)"),
    # a name too long for its system: the length and the limit, not a complaint about characters
    (_replace("name: tiny", "name: " + "a" * 203), "pipeline.name", 2,
     "a dag_id is too long (got 203 characters, 'aaaaaaaaaaaaaaaaaaaaaaaa...'; expected at most "
     "200)"),
    (_replace("  name: tiny\n", "  name: ''\n"), "pipeline.name", 2, "a dag_id may not be empty"),
    (_replace("model_name: tiny-llm", "model_name: " + "m" * 300), "registry.model_name", 14,
     "a registered model name is too long (got 300 characters"),
    (MINIMAL + "stages:\n  - name: " + "s" * 64 + "\n", "stages.0.name", 16,
     "a stage name is too long (got 64 characters"),
    (_under("training:\n", "  engine: slurm\n  slurm:\n    partition: " + "p" * 65 + "\n"),
     "training.slurm.partition", 8, "partition is too long (got 65 characters"),
    (_under("training:\n", "  engine: kubernetes\n  kubernetes:\n    image_pull_secrets: ["
            + "k" * 254 + "]\n"), "training.kubernetes.image_pull_secrets", 8,
     "image_pull_secrets is too long (got 254 characters, 'kkkkkkkkkkkkkkkkkkkkkkkk...'; "
     "expected at most 253)"),
    # durations: a delay may be zero, a timeout or an interval may not
    (_under("pipeline:\n", "  defaults:\n    execution_timeout: 0s\n"),
     "pipeline.defaults.execution_timeout", 3, "a duration must be longer than zero (got '0s')"),
    (_under("training:\n", "  fault:\n    poll_interval: 0s\n"), "training.fault.poll_interval", 7,
     "a duration must be longer than zero"),
    (_under("training:\n", "  fault:\n    collective_timeout: 0m\n"),
     "training.fault.collective_timeout", 7, "a duration must be longer than zero"),
    # found by fuzzing the loader (test_loader_fuzz.py): each was a traceback, a silently
    # ignored value, or a line without its field
    (_under("pipeline:\n", "  start_date: !!timestamp hello\n"), "pipeline.start_date", 2,
     "YAML could not read 'hello' as !!timestamp (AttributeError"),
    (_under("pipeline:\n", "  catchup: !!bool maybe\n"), "pipeline.catchup", 2,
     "YAML could not read 'maybe' as !!bool (KeyError"),
    (MINIMAL + "model: !custom {hidden_size: 256}\n", "model", 15,
     "YAML tags are not supported in a pipeline spec (got !custom; expected the value without "
     "a tag)"),
    (_replace("  checkpoint:\n", "  checkpoint: !!set\n"), "training.checkpoint", 11,
     "YAML tags are not supported in a pipeline spec (got !!set"),
    (_under("data:\n", "  'validation_fraction ': 0.1\n"), 'data."validation_fraction "', 4,
     "unknown field (got 'validation_fraction '; did you mean 'validation_fraction'?)"),
    (_under("pipeline:\n", "  owner: " + "9" * 400 + "\n"), "pipeline.owner", 2,
     "(got 9999999999999999999999999999999999999999... (400 characters); YAML read the unquoted"),
    # credentials never come from the spec
    (_under("training:\n", "  engine: ray\n  ray:\n    env_vars: {AWS_SECRET_ACCESS_KEY: x}\n"),
     "training.ray.env_vars", 8, "env_vars may not carry credentials"),
    (_under("training:\n", "  engine: slurm\n  slurm:\n    env_vars:\n      HF_TOKEN: x\n"),
     "training.slurm.env_vars", 8, "(got HF_TOKEN; expected no secret in the spec"),
]


@pytest.mark.parametrize("text,path,line,fragment", CASES)
def test_invalid_specs_point_at_the_field_and_line(text, path, line, fragment):
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    issues = info.value.issues
    match = [i for i in issues if i.path == path]
    assert match, f"no issue at {path!r}: {[str(i) for i in issues]}"
    assert match[0].line == line, str(match[0])
    assert fragment in match[0].message, str(match[0])
    assert str(match[0]).startswith(f"bad.yaml:{line}:")


@pytest.mark.parametrize("text,paths", [
    # the asset form of a schedule: no "Input should be a valid string" from the cron branch
    (_under("pipeline:\n", "  schedule:\n    assets: [corpus]\n"), ["pipeline.schedule.assets"]),
    (MINIMAL + "model:\n  config_overrides: {rope_scaling: {type: linear}}\n",
     ["model.config_overrides.rope_scaling"]),
    # the kubernetes engine's three needs at once, not one per edit
    (_under("training:\n", "  engine: kubernetes\n"),
     ["training.resources.image", "data.output_uri", "training.checkpoint.uri"]),
])
def test_each_mistake_is_one_issue(text, paths):
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    assert [i.path for i in info.value.issues] == paths, str(info.value)


@pytest.mark.parametrize("text,lines", [
    # `name:` and `schedule:` beside `pipeline:`, with pipeline missing, empty, or holding
    # the rest: one line per misplaced key, no "required" or "section is empty" besides
    ("name: tiny\nschedule: '@daily'\n" + MINIMAL.replace("pipeline:\n  name: tiny\n", ""),
     ["bad.yaml:1:1: name: unknown field at the top level (got 'name'; did you mean "
      "pipeline.name? move it under pipeline:)",
      "bad.yaml:2:1: schedule: unknown field at the top level (got 'schedule'; did you mean "
      "pipeline.schedule? move it under pipeline:)"]),
    (MINIMAL.replace("  name: tiny\n", "name: tiny\nschedule: '@daily'\n"),
     ["bad.yaml:2:1: name: unknown field at the top level (got 'name'; did you mean "
      "pipeline.name? move it under pipeline:)",
      "bad.yaml:3:1: schedule: unknown field at the top level (got 'schedule'; did you mean "
      "pipeline.schedule? move it under pipeline:)"]),
    (MINIMAL.replace("  name: tiny\n", "  name: tiny\nschedule: '@daily'\n"),
     ["bad.yaml:3:1: schedule: unknown field at the top level (got 'schedule'; did you mean "
      "pipeline.schedule? move it under pipeline:)"]),
    # a section still missing what no misplaced key gives keeps its own error
    ("schedule: '@daily'\n" + MINIMAL.replace("pipeline:\n  name: tiny\n", ""),
     ["bad.yaml:1:1: pipeline: required field is missing",
      "bad.yaml:1:1: schedule: unknown field at the top level (got 'schedule'; did you mean "
      "pipeline.schedule? move it under pipeline:)"]),
])
def test_a_misplaced_key_is_one_line_naming_where_it_belongs(text, lines):
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    assert str(info.value).splitlines() == lines


def test_a_zero_retry_delay_is_accepted_as_airflow_does():
    import datetime as dt

    from trainforge.dag_builder import build_dag

    text = _under("pipeline:\n", "  defaults:\n    retry_delay: 0s\n  tasks:\n    train:\n"
                  "      retry_delay: 0s\n")
    spec = parse_spec_text(text, "ok.yaml")
    assert spec.pipeline.defaults.retry_delay == 0 == spec.pipeline.tasks.train.retry_delay
    assert spec.model_dump(mode="json")["pipeline"]["defaults"]["retry_delay"] == "0s"
    dag = build_dag(spec)
    assert {t.retry_delay for t in dag.tasks} == {dt.timedelta(0)}


def test_all_errors_of_a_file_are_reported_at_once():
    text = _replace("learning_rate: 1e-3", "learnin_rate: 1e-3").replace(
        "max_steps: 10", "max_steps: -1"
    )
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    paths = {i.path for i in info.value.issues}
    assert {"training.optimization.learnin_rate", "training.optimization.max_steps"} <= paths


def test_overrides_are_validated_by_the_same_model():
    spec = parse_spec_text(MINIMAL)
    assert (
        validate_overrides(
            spec, {"training.optimization.max_steps": 20}
        ).training.optimization.max_steps
        == 20
    )
    with pytest.raises(SpecError, match="max_steps"):
        validate_overrides(spec, {"training.optimization.max_steps": 0})
    with pytest.raises(SpecError, match="unknown field"):
        validate_overrides(spec, {"training.optimization.max_stepz": 3})
    with pytest.raises(SpecError, match="max_steps: expected a number, not a boolean"):
        validate_overrides(spec, {"training.optimization.max_steps": True})


@pytest.mark.parametrize("text,line,fragment", [
    (_under("pipeline:\n", "  start_date: 2026-13-45\n"), 2,
     "not a valid date (got '2026-13-45': month must be in 1..12; expected YYYY-MM-DD)"),
    (MINIMAL + "? [a, b]\n: 1\n", 15, "a key must be a plain name"),
    (MINIMAL.replace("model_name: tiny-llm", "<<: {model_name: tiny-llm}"), 14, "merge keys"),
    (MINIMAL.replace("model_name: tiny-llm", "model_name: &n tiny-llm\n  tags: {x: *n}"), 15,
     "YAML aliases are not supported in a pipeline spec (got the alias *n; expected the value "
     "written out)"),
])
def test_yaml_that_cannot_become_data_is_an_error_not_a_crash(text, line, fragment):
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    assert info.value.issues[0].line == line and fragment in str(info.value)


@pytest.mark.parametrize("text,where", [
    # every line names its field, also when YAML cannot read the file
    (MINIMAL.replace("name: tiny", "name: ti\x01ny"), "2:11: pipeline.name:"),
    (MINIMAL.replace("  checkpoint:\n", "  checkpoint:\n\x1b"), "12:1: training.checkpoint:"),
    (MINIMAL.replace("tiny-llm", "tiny\udce9"), "14:19: registry.model_name: not UTF-8 text"),
    (MINIMAL.replace("model_name: tiny-llm", "<<: {model_name: tiny-llm}"), "14:3: registry:"),
    (MINIMAL.replace("model_name: tiny-llm", "model_name: &n tiny-llm\n  tags: {x: *n}"),
     "15:13: registry.tags.x: YAML aliases are not supported"),
    (MINIMAL.replace("    interval_steps: 5\n", "    interval_steps: 5\n   keep_last: 3\n"),
     "13:4: training: YAML syntax error"),
    (MINIMAL.replace("  checkpoint:\n", " checkpoint:\n"),
     "11:2: (top level): YAML syntax error: did not find expected key (check the indentation"),
    ("", "1:1: (top level): the file is empty"),
])
def test_a_problem_yaml_finds_names_the_field_it_is_in(text, where):
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    assert str(info.value).startswith(f"bad.yaml:{where}"), str(info.value)


def test_a_file_that_is_not_utf8_is_reported_with_its_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(MINIMAL.encode() + "owner: Jos\xe9\n".encode("latin-1"))
    # line 15, column 11: the byte after "owner: Jos"
    with pytest.raises(SpecError, match=r"latin1.yaml:15:11: owner: not UTF-8 text \(got byte 0xe9"):
        load_spec(path)


def test_a_value_yaml_cannot_read_does_not_hide_the_other_errors():
    text = _under("pipeline:\n", "  start_date: 2026-02-30\n  defaults:\n    retries: yes\n")
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    assert [(i.path, i.line) for i in info.value.issues] == [
        ("pipeline.start_date", 2), ("pipeline.defaults.retries", 4)]
    assert "day is out of range for month; expected YYYY-MM-DD" in info.value.issues[0].message


@pytest.mark.parametrize("name,secret", [
    ("AWS_SECRET_ACCESS_KEY", True), ("AWS_ACCESS_KEY_ID", True), ("AWS_SESSION_TOKEN", True),
    ("HF_TOKEN", True), ("WANDB_API_KEY", True), ("DB_PASSWORD", True), ("MY_SECRET", True),
    ("HF_HOME", False), ("TOKENIZERS_PARALLELISM", False), ("NCCL_DEBUG", False),
    ("KEYBOARD", False),
])
def test_credential_names(name, secret):
    from trainforge.engines.blocks import is_credential_name

    assert is_credential_name(name) is secret


def test_nested_aliases_are_refused_before_they_expand():
    """Nine lines of nested aliases would expand to 9**9 values ("billion laughs"); the refusal
    comes from the event stream, before anything is built."""
    import time

    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    started = time.monotonic()
    with pytest.raises(SpecError) as info:
        parse_spec_text("\n".join(lines) + "\n", "bomb.yaml")
    assert time.monotonic() - started < 5
    issue = info.value.issues[0]
    assert (issue.line, issue.column) == (2, 10) and "alias *a0" in issue.message


def test_a_glob_with_a_star_is_not_taken_for_an_alias():
    spec = parse_spec_text(MINIMAL, "ok.yaml")
    text = MINIMAL.replace(spec.data.sources[0], "corpus/*/x-*.txt")
    assert "corpus/*/x-*.txt" in text
    assert parse_spec_text(text, "ok.yaml").data.sources == ["corpus/*/x-*.txt"]


def test_flow_style_and_bom_prefixed_aliases_are_refused_too():
    """An anchor right after ':' in a flow mapping, or after a byte-order mark, is an anchor
    all the same: the refusal must not depend on what precedes the '&'."""
    flow = MINIMAL.replace("model_name: tiny-llm",
                           'model_name: tiny-llm\n  tags: {"a":&a [x, x], "b": [*a, *a]}')
    bom = "\ufeff&a [*a, *a]\n"
    for text in (flow, bom):
        with pytest.raises(SpecError, match="YAML aliases are not supported"):
            parse_spec_text(text, "bad.yaml")


def test_thousands_of_mistakes_are_listed_in_linear_time():
    import time

    text = MINIMAL + "".join(f"unknown_{i}: 1\n" for i in range(20_000))
    started = time.monotonic()
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "many.yaml")
    assert len(info.value.issues) == 20_000
    # about 1 s; the quadratic de-duplication it replaces took over 30 s for this file
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("char", ["\x00", "\x01", "\x1b"])
def test_a_control_character_is_reported_at_its_line_not_as_a_traceback(char):
    text = MINIMAL.replace("name: tiny", f"name: ti{char}ny")
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "ctl.yaml")
    [issue] = info.value.issues
    assert (issue.line, issue.column) == (2, 11)
    assert f"YAML does not allow the control character {char!r}" in issue.message


def test_a_spec_with_a_control_character_never_hides_the_others(tmp_path):
    from trainforge.dag_builder import build_dags

    (tmp_path / "a.yaml").write_text(MINIMAL)
    (tmp_path / "b.yaml").write_text(MINIMAL.replace("name: tiny", "name: other\x00"))
    dags, errors = build_dags(tmp_path)
    assert list(dags) == ["tiny"] and list(errors) == [str(tmp_path / "b.yaml")]
