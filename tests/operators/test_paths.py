"""Local paths and s3:// URIs of checkpoints and datasets: trainforge.paths and the spec's
``training.checkpoint.uri`` (pure unit tests)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainforge.paths import checkpoint_root, dataset_location, resolve
from trainforge.pipeline.spec import CheckpointSection


def test_checkpoint_root_keeps_s3_uris_intact(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    run_id = "manual__2026-01-02T03:04:05+00:00"
    assert checkpoint_root("s3://ckpt-bucket/team/llm", "tiny", run_id) == \
        "s3://ckpt-bucket/team/llm/tiny/manual__2026-01-02T03_04_05_00_00"
    assert checkpoint_root("s3://ckpt-bucket/", "tiny", "r1") == "s3://ckpt-bucket/tiny/r1"
    assert checkpoint_root("s3://ckpt-bucket", "tiny", "r1") == "s3://ckpt-bucket/tiny/r1"
    assert checkpoint_root("checkpoints", "tiny", "r1") == str(tmp_path / "checkpoints" / "tiny" / "r1")
    assert checkpoint_root("/abs/ckpt", "tiny", "r1") == "/abs/ckpt/tiny/r1"
    assert resolve("s3://b-1/x") == "s3://b-1/x"


def test_dataset_location_prefers_the_s3_copy():
    local = {"dataset_dir": "/home/ds/abc", "dataset_uri": "file:///home/ds/abc"}
    assert dataset_location(local) == "/home/ds/abc"
    staged = {"dataset_dir": "/home/staging/datasets/b/p/abc", "dataset_uri": "s3://b-1/p/abc/"}
    assert dataset_location(staged) == "s3://b-1/p/abc"
    assert dataset_location({"dataset_dir": "/d"}) == "/d"  # XCom from before dataset_uri existed


@pytest.mark.parametrize("uri", ["checkpoints", "/mnt/ckpt", "s3://my-bucket", "s3://my.bucket/a/b"])
def test_checkpoint_uri_accepts_local_folders_and_s3(uri):
    assert CheckpointSection(interval_steps=10, uri=uri).uri == uri


@pytest.mark.parametrize(("uri", "fragment"), [
    ("gs://bucket/ckpt", "checkpoint uri must be a local folder or an s3://bucket/prefix URI (got 'gs://bucket/ckpt'"),
    ("s3://Bucket/ckpt", "(got 's3://Bucket/ckpt'"),
    ("s3://", "(got 's3://'"),
    ("http://minio:9000/ckpt", "(got 'http://minio:9000/ckpt'"),
])
def test_checkpoint_uri_errors_name_the_value(uri, fragment):
    with pytest.raises(ValidationError) as info:
        CheckpointSection(interval_steps=10, uri=uri)
    assert fragment in str(info.value)
