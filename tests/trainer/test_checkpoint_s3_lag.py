"""Checkpoints on an S3-compatible store whose reads lag its writes (a real moto server on
loopback behind a lagging client: HEAD/GET answer 404 for a while after a PUT): a checkpoint the
product has just written reads back as a checkpoint — after a bounded, reported wait — while a
folder the product did not just write is judged at once."""

from __future__ import annotations

import logging
import time

import pytest

from trainforge.storage import s3
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer import checkpoint_manifest
from tests.operators.storage.lagging_s3 import ReadAfterWriteLag
from tests.trainer.test_checkpoint_s3 import _write, bucket  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration
LAG_S = 1.5


@pytest.fixture
def lagging(bucket, monkeypatch):  # noqa: F811 - the imported fixture
    monkeypatch.setenv("TRAINFORGE_S3_SETTLE_S", "10")
    lag = ReadAfterWriteLag(s3.client(), LAG_S)
    yield lag
    lag.close()


def test_a_checkpoint_just_written_verifies_after_the_store_s_lag(bucket, lagging, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING)
    root = f"{bucket}/runs/lag"
    uri = _write(root, 10)
    started = time.monotonic()
    assert ckpt.verify(uri) == []
    assert time.monotonic() - started < 10
    assert ("HeadObject" in {op for op, _ in lagging.hidden}
            or "GetObject" in {op for op, _ in lagging.hidden})
    assert "checkpoint manifest" in caplog.text and "became readable" in caplog.text
    assert ckpt.newest_valid(root) == uri and ckpt.load_checkpoint(uri).step == 10


def test_a_checkpoint_another_process_just_wrote_waits_only_when_the_caller_says_so(
        bucket, lagging):  # noqa: F811
    root = f"{bucket}/runs/other"
    uri = _write(root, 20)
    checkpoint_manifest._WRITTEN.clear()  # as in the validator's process, which did not write it
    assert "missing (a folder without a manifest" in ckpt.verify(uri)[0]  # judged at once
    assert ckpt.verify(uri, written=True) == []
    with ckpt.local_copy(uri, written=True) as folder:
        assert ckpt.verify(folder) == []


def test_a_folder_the_product_did_not_just_write_is_not_waited_for(bucket, lagging):  # noqa: F811
    root = f"{bucket}/runs/torn"
    s3.put_bytes(f"{root}/step-00000040/{ckpt.WEIGHTS}", b"half an upload")  # no manifest
    started = time.monotonic()
    assert "missing (a folder without a manifest" in ckpt.verify(f"{root}/step-00000040")[0]
    assert time.monotonic() - started < LAG_S
