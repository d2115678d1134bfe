"""A dataset prepare_data has just uploaded, read by the trainer from an S3-compatible store
whose reads lag its writes (a real moto server behind a lagging client): read after a bounded,
reported wait, not refused as "a dataset without a manifest"."""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest

from trainforge.storage import s3
from trainforge.trainer.data import open_dataset
from trainforge.trainer.errors import DatasetError
from tests.operators.storage.lagging_s3 import ReadAfterWriteLag

pytestmark = pytest.mark.integration
LAG_S = 1.5


@pytest.fixture
def lagging_upload(s3_server, monkeypatch, dataset_dir, tmp_path):
    """The trainer tests' dataset uploaded (manifest last) through a client whose reads lag."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("TRAINFORGE_DATASET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TRAINFORGE_S3_SETTLE_S", "10")
    bucket = f"data-{uuid.uuid4().hex[:10]}"
    s3.client().create_bucket(Bucket=bucket)
    lag = ReadAfterWriteLag(s3.client(), LAG_S)
    digest = json.loads((dataset_dir / "manifest.json").read_text())["digest"]
    uri = f"s3://{bucket}/datasets/{digest}"
    for path in sorted(dataset_dir.iterdir(), key=lambda p: p.name == "manifest.json"):
        s3.upload_file(path, f"{uri}/{path.name}")
    yield uri, lag
    lag.close()


def test_a_dataset_just_uploaded_is_read_after_the_store_s_lag(lagging_upload, dataset_dir, caplog):
    uri, lag = lagging_upload
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    remote = open_dataset(uri)
    assert remote.digest == open_dataset(dataset_dir).digest
    assert time.monotonic() - started < 10 and lag.hidden
    assert "dataset manifest" in caplog.text and "became readable" in caplog.text


def test_a_dataset_that_never_appears_is_missing_after_a_bounded_wait(lagging_upload, monkeypatch):
    uri, _ = lagging_upload
    monkeypatch.setenv("TRAINFORGE_S3_SETTLE_S", "0.5")
    s3.delete_keys(uri, [s3.split(f"{uri}/manifest.json")[1]])
    started = time.monotonic()
    with pytest.raises(DatasetError, match=r"manifest.json: missing \(still missing after waiting "
                                           r"0\.\d s for the store\); a dataset without a manifest"):
        open_dataset(uri)
    assert time.monotonic() - started < 5
