"""trainforge.trainer.config: every field checked once, errors name the field, the value and the expectation."""

from __future__ import annotations

import copy
import json

import pytest

from trainforge.trainer.config import FrameworkConfig, load_job_config, parse_job_config
from trainforge.trainer.errors import ConfigError


def _set(job: dict, dotted: str, value) -> dict:
    job = copy.deepcopy(job)
    *parents, leaf = dotted.split(".")
    node = job
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return job


_DELETE = object()

ERROR_ROWS = [
    # (field, value, message fragment)
    ("format", "trainforge.job/v2", "format='trainforge.job/v2': expected 'trainforge.job/v1'"),
    ("model", _DELETE, "model: required field is missing"),
    ("optim.learning_rate", _DELETE, "optim.learning_rate: required field is missing"),
    ("optim.lr", 0.1, "unknown field(s) optim.lr"),
    ("extra_section", {}, "unknown field(s) extra_section"),
    ("optim.max_steps", "300", "optim.max_steps='300' (str): expected an integer"),
    ("optim.max_steps", True, "optim.max_steps=True (bool): expected an integer"),
    ("optim.max_steps", 2.5, "optim.max_steps=2.5 (float): expected an integer"),
    ("optim.max_steps", 0, "optim.max_steps=0: expected a value >= 1"),
    ("optim.learning_rate", 0, "optim.learning_rate=0.0: expected a value > 0.0"),
    ("optim.learning_rate", "3e-4", "optim.learning_rate='3e-4' (str): expected a number"),
    ("optim.beta2", 1.0, "optim.beta2=1.0: expected a value in [0.0, 1.0)"),
    ("optim.weight_decay", -0.1, "optim.weight_decay=-0.1: expected a value >= 0.0"),
    (
        "optim.min_learning_rate",
        0.5,
        "optim.min_learning_rate=0.5 must be <= optim.learning_rate=0.01",
    ),
    ("optim.warmup_steps", 21, "optim.warmup_steps=21 must be <= optim.max_steps=20"),
    (
        "optim.global_batch_size",
        7,
        "optim.global_batch_size=7 must be a multiple of optim.micro_batch_size=2",
    ),
    ("model.dropout", 1.0, "model.dropout=1.0: expected a value in [0.0, 1.0)"),
    ("model.family", "gpt2", "model.family='gpt2': expected one of ['llama']"),
    ("model.hidden_size", 30, "model.hidden_size=30 must be divisible by num_heads=4"),
    ("model.num_kv_heads", 3, "model.num_heads=4 must be a multiple of num_kv_heads=3"),
    ("model.tie_word_embeddings", 1, "model.tie_word_embeddings=1 (int): expected true or false"),
    ("precision", "fp4", "precision='fp4': expected one of ['fp32', 'bf16', 'fp16', 'fp8']"),
    (
        "distributed.backend",
        "mpi",
        "distributed.backend='mpi': expected one of ['auto', 'gloo', 'nccl']",
    ),
    (
        "distributed.collective_timeout_s",
        0,
        "distributed.collective_timeout_s=0.0: expected a value > 0.0",
    ),
    (
        "distributed.world_size_change",
        "reshard",
        "distributed.world_size_change='reshard': expected one of ['continue', 'refuse']",
    ),
    (
        "data.dataset_dir",
        "datasets/abc",
        "data.dataset_dir='datasets/abc': expected an absolute path or an s3://bucket/prefix URI",
    ),
    (
        "data.dataset_dir",
        "gs://bucket/datasets/abc",
        "data.dataset_dir='gs://bucket/datasets/abc': expected an absolute path or an s3://",
    ),
    (
        "checkpoint.dir",
        "s3://UPPER/ckpt",
        "checkpoint.dir='s3://UPPER/ckpt': expected an absolute path or an s3://bucket/prefix URI",
    ),
    ("checkpoint.dir", "ckpt", "checkpoint.dir='ckpt': expected an absolute path or an s3://"),
    ("data.sequence_length", 1, "data.sequence_length=1: expected a value in [2, 1048576]"),
    ("checkpoint.keep_last", 0, "checkpoint.keep_last=0: expected a value >= 1"),
    ("identity.try_number", 0, "identity.try_number=0: expected a value >= 1"),
    ("identity.dag_id", "", "identity.dag_id='' (str): expected a non-empty string"),
    ("logging", [], "logging: expected a JSON object, got [] (list)"),
]


@pytest.mark.parametrize(
    ("field", "value", "fragment"), ERROR_ROWS, ids=[f"{r[0]}=<deleted>" if r[1] is _DELETE else f"{r[0]}={r[1]!r}" for r in ERROR_ROWS]
)
def test_config_errors(valid_job, field, value, fragment):
    job = _set(valid_job, field, value)
    with pytest.raises(ConfigError) as info:
        parse_job_config(job)
    assert fragment in str(info.value)
    assert info.value.exit_code == 78


def test_odd_head_size_is_rejected(valid_job):
    job = _set(_set(valid_job, "model.hidden_size", 36), "model.num_heads", 12)
    job["model"]["num_kv_heads"] = 12
    with pytest.raises(ConfigError, match="even head size"):
        parse_job_config(job)


def test_valid_config_parses(valid_job):
    cfg = parse_job_config(valid_job)
    assert cfg.optim.learning_rate == 0.01 and isinstance(cfg.model.rope_theta, float)
    assert (
        cfg.grad_accum_steps(1) == 4
        and cfg.grad_accum_steps(2) == 2
        and cfg.grad_accum_steps(4) == 1
    )


def test_world_size_must_divide_the_global_batch(valid_job):
    cfg = parse_job_config(valid_job)
    with pytest.raises(ConfigError, match=r"micro_batch_size \(2\) x world size \(3\) = 6"):
        cfg.grad_accum_steps(3)


def test_digest_ignores_identity_only(valid_job):
    job = valid_job
    base = parse_job_config(job).digest()
    assert parse_job_config(_set(job, "identity.try_number", 2)).digest() == base
    assert parse_job_config(_set(job, "optim.seed", 7)).digest() != base


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(None, "cannot read"), ("{not json", "not valid JSON"), ('{"format": "x"}', "format='x'")],
)
def test_load_job_config_file_errors(tmp_path, content, fragment):
    path = tmp_path / "job.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=fragment) as info:
        load_job_config(path)
    assert str(path) in str(info.value)


def test_load_job_config_round_trip(valid_job, tmp_path):
    job = valid_job
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    assert load_job_config(path).raw == job


def test_s3_locations_are_accepted(valid_job):
    job = _set(_set(valid_job, "data.dataset_dir", "s3://data-bucket/datasets/abc123"),
               "checkpoint.dir", "s3://ckpt.bucket/runs/dag/run_1")
    cfg = parse_job_config(job)
    assert cfg.data.dataset_dir == "s3://data-bucket/datasets/abc123"
    assert cfg.checkpoint.dir == "s3://ckpt.bucket/runs/dag/run_1"


# --- framework.compile ------------------------------------------------------------------------------

def _with_framework(job: dict, **framework) -> dict:
    job = copy.deepcopy(job)
    job["framework"] = framework
    return job


def test_compile_defaults_to_auto_when_absent(valid_job):
    assert "framework" not in valid_job  # a job config written before the field
    assert parse_job_config(valid_job).framework.compile == "auto"
    assert parse_job_config(_with_framework(valid_job, parallelism="ddp")).framework.compile == "auto"


@pytest.mark.parametrize("value", ["auto", True, False])
def test_compile_accepts_auto_true_and_false(valid_job, value):
    cfg = parse_job_config(_with_framework(valid_job, compile=value))
    assert cfg.framework.compile == value and type(cfg.framework.compile) is type(value)


@pytest.mark.parametrize(("value", "fragment"), [
    ("yes-please", "framework.compile='yes-please' (str): expected 'auto', true or false"),
    ("true", "framework.compile='true' (str): expected 'auto', true or false"),
    ("AUTO", "framework.compile='AUTO' (str): expected 'auto', true or false"),
    (1, "framework.compile=1 (int): expected 'auto', true or false"),
    (0, "framework.compile=0 (int): expected 'auto', true or false"),
    (None, "framework.compile=None (NoneType): expected 'auto', true or false"),
    ({}, "framework.compile={} (dict): expected 'auto', true or false"),
])
def test_compile_errors_name_the_field_the_value_and_the_choices(valid_job, value, fragment):
    with pytest.raises(ConfigError) as info:
        parse_job_config(_with_framework(valid_job, compile=value))
    assert fragment in str(info.value)
    assert info.value.exit_code == 78


@pytest.mark.parametrize(("compile_", "device_type", "on"), [
    ("auto", "cuda", True),
    ("auto", "cpu", False),
    ("auto", "mps", False),
    (True, "cpu", True),
    (True, "cuda", True),
    (False, "cuda", False),
    (False, "cpu", False),
])
def test_compile_on_decides_auto_by_device_type(compile_, device_type, on):
    assert FrameworkConfig(compile=compile_).compile_on(device_type) is on


def test_compile_fallback_is_error_unless_warn_is_asked_for(valid_job):
    assert parse_job_config(valid_job).framework.compile_fallback == "error"  # absent: a limit hit fails
    assert parse_job_config(_with_framework(valid_job, compile_fallback="warn")).framework.compile_fallback == "warn"
    with pytest.raises(ConfigError) as info:
        parse_job_config(_with_framework(valid_job, compile_fallback="eager"))
    assert "framework.compile_fallback='eager': expected one of ['error', 'warn']" in str(info.value)
