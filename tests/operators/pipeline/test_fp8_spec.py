"""``precision: fp8`` at validate: refused without float8 GPUs and with micro-batches of a token
count float8 matmuls cannot take; accepted and rendered on an H100 (operators/pipeline/framework.py)."""

from __future__ import annotations

import pytest

from trainforge.pipeline import SpecError, parse_spec_text
from trainforge.pipeline.framework import NO_FLOAT8

SPEC = """\
pipeline:
  name: tiny
data:
  sources: [corpus/*.txt]
  sequence_length: {seq}
training:
  engine: slurm
  slurm:
    gpu_type: {gpu}
  resources:
    gpus_per_node: {gpus}
    processes_per_node: 2
  framework:
    precision: fp8
  optimization:
    max_steps: 10
    global_batch_size: {glob}
    micro_batch_size: {micro}
    learning_rate: 1e-3
  checkpoint:
    interval_steps: 5
    uri: s3://bucket/ck
registry:
  model_name: tiny-llm
storage:
  endpoint_url: http://s3.local:9000
"""


def _spec(seq: int = 256, gpu: str = "h100", gpus: int = 2, micro: int = 2) -> str:
    return SPEC.format(seq=seq, gpu=gpu, gpus=gpus, micro=micro, glob=4 * micro).replace("data:\n", "data:\n  output_uri: s3://bucket/data\n")


def _line(text: str, line: str) -> int:
    return text.splitlines().index(line) + 1


def _issues(text: str) -> list:
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    return info.value.issues


def test_fp8_on_an_h100_is_accepted_and_reaches_the_job_config():
    from trainforge.engines.base import JobIdentity
    from trainforge.jobconfig import build_training_job

    spec = parse_spec_text(_spec(), "ok.yaml")
    assert spec.training.framework.precision == "fp8"
    job = build_training_job(spec, "/data", "s3://bucket/ck", JobIdentity("tiny", "r", "train", 1), {})
    assert job.config["precision"] == "fp8"


def test_fp8_without_gpus_is_refused_naming_the_requirement():
    text = _spec(gpus=0).replace("    processes_per_node: 2\n", "")
    issue, = [i for i in _issues(text) if i.path == "training.framework.precision"]
    assert issue.line == _line(text, "    precision: fp8")
    assert ("precision 'fp8': float8 training needs CUDA GPUs of compute capability 8.9 or higher (H100, H200, "
            "L4, L40S, Ada), and the job requests none (got resources.gpus_per_node 0") in issue.message


@pytest.mark.parametrize("gpu", ["a100", "nvidia_a100-sxm4-80gb", "V100", "t4"])
def test_fp8_on_a_gpu_type_without_float8_is_refused(gpu):
    text = _spec(gpu=gpu)
    issue, = [i for i in _issues(text) if i.path == "training.framework.precision"]
    assert issue.line == _line(text, "    precision: fp8") and gpu.lower() in issue.message.lower()
    assert "compute capability 8.9 or higher" in issue.message and f"training.slurm.gpu_type {gpu!r}" in issue.message
    assert "expected such a gpu_type, or precision 'bf16'" in issue.message


def test_float8_gpu_types_are_not_in_the_refused_list():
    assert not NO_FLOAT8 & {"h100", "h200", "gh200", "l4", "l40", "l40s", "b200", "rtx4090"}


def test_a_micro_batch_token_count_not_divisible_by_16_is_refused():
    text = _spec(seq=100, micro=1)
    issue, = [i for i in _issues(text) if i.path == "training.optimization.micro_batch_size"]
    assert issue.line == _line(text, "    micro_batch_size: 1")
    assert issue.message == ("precision 'fp8' needs the tokens of a micro-batch divisible by 16 (got "
                             "micro_batch_size 1 x data.sequence_length 100 = 100; expected a multiple of "
                             "16, e.g. sequence_length 112)")
    parse_spec_text(_spec(seq=100, micro=4), "ok.yaml")  # 400 tokens: divisible
