"""Reading back what the product just wrote (trainforge.storage.settle): bounded, growing waits
on stores whose reads lag writes, none on the local disk, the wait reported. Pure unit tests
with a fake clock, plus the real S3 storage against moto with a lagging client."""

from __future__ import annotations

import logging
import uuid

import pytest

from trainforge.storage import LocalStorage, S3Storage, s3
from trainforge.storage.settle import read_written, settled
from tests.operators.storage.lagging_s3 import ReadAfterWriteLag


class Clock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_lagging_object_is_read_again_until_it_appears_and_the_wait_is_logged(caplog):
    clock = Clock()
    answers = iter([None, None, None, b"{}"])
    caplog.set_level(logging.WARNING, "trainforge.storage.settle")
    value, waited = settled(lambda _: next(answers), "s3://b/m.json", "checkpoint manifest", 30.0,
                            clock, clock.sleep)
    assert value == b"{}" and clock.sleeps == [0.25, 0.5, 1.0] and waited == 1.75
    assert "checkpoint manifest s3://b/m.json became readable 1.8 s after it was written" in caplog.text


def test_the_wait_is_bounded_and_a_missing_object_stays_missing(caplog):
    clock = Clock()
    caplog.set_level(logging.WARNING, "trainforge.storage.settle")
    value, waited = settled(lambda _: None, "s3://b/m.json", "dataset manifest", 10.0, clock,
                            clock.sleep)
    assert value is None and waited == 10.0 and max(clock.sleeps) == 4.0
    assert "still missing after waiting 10.0 s" in caplog.text


def test_no_wait_without_a_settle_time(tmp_path):
    clock = Clock()
    assert settled(lambda _: None, tmp_path / "x", "file", 0.0, clock, clock.sleep) == (None, 0.0)
    assert clock.sleeps == []
    assert LocalStorage().settle_s == 0.0


@pytest.mark.integration
def test_s3_storage_reads_back_its_own_write_through_the_lag(s3_server, monkeypatch, caplog):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    client = s3.make_client(s3_server)
    bucket = f"lag-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    lag = ReadAfterWriteLag(client, lag_s=1.0)
    store = S3Storage(lambda: client, settle_s=5.0)
    caplog.set_level(logging.WARNING, "trainforge.storage.settle")
    try:
        store.write_bytes(f"s3://{bucket}/m.json", b"{}")
        assert store.read_bytes(f"s3://{bucket}/m.json") is None  # what a plain read sees
        data, waited = read_written(store, f"s3://{bucket}/m.json", "manifest")
        assert data == b"{}" and 0.5 < waited < 5.0
        assert "became readable" in caplog.text
    finally:
        lag.close()
