"""S3-compatible stores that predate the flexible checksums of newer AWS SDKs: they refuse an
``aws-chunked`` body with a trailing ``x-amz-checksum-*`` (``XAmzContentSHA256Mismatch``) and need
``Content-MD5`` on DeleteObjects. Played by the stack's stand-in store in that mode on loopback
(``strict_s3_server``, docker/local/s3-server.py): the store really refuses what botocore sends
by default, and objects, multipart uploads, deletes, a prepared dataset and a checkpoint
round-trip with the client's defaults."""

from __future__ import annotations

import hashlib
import uuid

import pytest
from botocore.exceptions import ClientError

from tests.operators.data.conftest import settings_for, write_corpus
from trainforge.storage import StorageError, s3

pytestmark = pytest.mark.integration


@pytest.fixture
def strict_bucket(strict_s3_server, monkeypatch) -> str:
    """A bucket of the strict store, which the environment's endpoint names; botocore's
    checksum settings left to the client's defaults."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": strict_s3_server}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_ENDPOINT_URL_S3", *s3.CHECKSUM_ENV.values()):
        monkeypatch.delenv(key, raising=False)
    name = f"strict-{uuid.uuid4().hex[:10]}"
    s3.make_client(strict_s3_server).create_bucket(Bucket=name)
    return f"s3://{name}"


def test_the_store_refuses_what_botocore_sends_by_default(strict_s3_server, strict_bucket,
                                                          monkeypatch):
    import boto3
    from botocore.config import Config

    bucket = strict_bucket.removeprefix("s3://")
    newer = boto3.client("s3", endpoint_url=strict_s3_server,
                         config=Config(request_checksum_calculation="when_supported"))
    with pytest.raises(ClientError) as caught:
        newer.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert caught.value.response["Error"]["Code"] == "XAmzContentSHA256Mismatch"
    required = boto3.client("s3", endpoint_url=strict_s3_server,
                            config=Config(request_checksum_calculation="when_required"))
    required.put_object(Bucket=bucket, Key="k", Body=b"x")  # no checksum: accepted
    with pytest.raises(ClientError) as caught:  # botocore's CRC32 where S3 needs a checksum
        required.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "k"}]})
    assert caught.value.response["Error"]["Code"] == "XAmzContentSHA256Mismatch"
    # The variables bring botocore's newer default back to our client, and the error says so.
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_supported")
    with pytest.raises(StorageError, match="XAmzContentSHA256Mismatch"):
        s3.put_bytes(f"{strict_bucket}/k2", b"x", s3.make_client(strict_s3_server))


def test_objects_multipart_uploads_copies_and_deletes_round_trip(strict_bucket, tmp_path):
    client = s3.make_client()
    s3.put_bytes(f"{strict_bucket}/a/small.json", b"{}", client)
    assert s3.get_bytes(f"{strict_bucket}/a/small.json", client) == b"{}"
    big = tmp_path / "big.bin"
    big.write_bytes(hashlib.sha256(b"seed").digest() * ((2 * s3.MULTIPART_BYTES + 12345) // 32))
    s3.upload_file(big, f"{strict_bucket}/a/big.bin", client)  # three parts
    back = tmp_path / "back.bin"
    s3.download_file(f"{strict_bucket}/a/big.bin", back, client)
    assert back.read_bytes() == big.read_bytes()
    s3.copy(f"{strict_bucket}/a/big.bin", f"{strict_bucket}/a/copy.bin", client)
    assert s3.size_of(f"{strict_bucket}/a/copy.bin", client) == big.stat().st_size
    assert s3.delete_prefix(f"{strict_bucket}/a", client) == 3  # DeleteObjects with Content-MD5
    assert list(s3.list_keys(f"{strict_bucket}/a/", client)) == []


def test_a_prepared_dataset_and_a_checkpoint_round_trip(strict_s3_server, strict_bucket, tmp_path):
    import torch

    from trainforge.data import prepare_dataset, verify_dataset
    from trainforge.trainer import checkpoint as ckpt

    write_corpus(tmp_path / "corpus")
    settings = settings_for(tmp_path / "corpus" / "*.txt", s3_endpoint_url=strict_s3_server)
    first = prepare_dataset(settings, f"{strict_bucket}/datasets", staging_root=tmp_path / "a")
    fresh = prepare_dataset(settings, f"{strict_bucket}/datasets", staging_root=tmp_path / "b")
    assert fresh.reuse == "remote" and verify_dataset(fresh.path) == []
    assert {p.name: p.read_bytes() for p in fresh.path.iterdir()} == \
        {p.name: p.read_bytes() for p in first.path.iterdir()}

    root = f"{strict_bucket}/runs/r1"
    weights = {"w": torch.arange(12, dtype=torch.float32)}
    for step in (10, 20):
        state = {"step": step, "tokens_seen": step, "world_size": 1,
                 "scheduler": {"step": step}, "rng": [ckpt.capture_rng_state()]}
        ckpt.write_checkpoint(root, step, weights, {"state": {}, "param_groups": []}, state,
                              {"step": step})
    newest = ckpt.newest_valid(root)
    assert newest == f"{root}/step-00000020" and ckpt.verify(newest) == []
    loaded = ckpt.load_checkpoint(newest)
    assert torch.equal(loaded.weights["w"], weights["w"])
    assert ckpt.apply_retention(root, keep_last=1) == [f"{root}/step-00000010"]  # DeleteObjects
    assert ckpt.list_step_dirs(root) == [(20, newest)]
