"""S3 requests that the store keeps throttling, against a real S3-compatible server (moto in
server mode on loopback) behind a proxy answering real ``HTTP 503 SlowDown``
(``throttling_s3_proxy``): how many attempts go on the wire — the number the docs state — and
what the error says after the last one."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from trainforge.storage import StorageError, s3
from trainforge.storage.s3_errors import THROTTLE_REMEDY

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def proxied(s3_server, throttling_s3_proxy, monkeypatch):
    """``(client through the proxy, bucket URI, proxy)``; botocore's back-off waits 0 s."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("botocore.retries.standard.ExponentialBackoff.delay_amount",
                        lambda self, context: 0.0)
    client = s3.make_client(throttling_s3_proxy.url)
    name = f"thr-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=name)
    return client, f"s3://{name}", throttling_s3_proxy


def _documented_attempts() -> set[int]:
    """Every "N attempts" the S3 docs state (docs/storage.md and the client's module doc)."""
    texts = [(ROOT / "docs" / "storage.md").read_text(), s3.__doc__ or ""]
    found = {int(n) for text in texts for n in re.findall(r"(\d+) attempts", text)}
    assert found, "the docs no longer state the number of attempts"
    return found


@pytest.mark.parametrize("operation,call", [
    ("PutObject", lambda c, b: s3.put_bytes(f"{b}/k", b"x", c)),
    ("HeadObject", lambda c, b: s3.size_of(f"{b}/k", c)),
    ("GetObject", lambda c, b: s3.get_bytes(f"{b}/k", c)),
])
def test_attempts_on_the_wire_are_the_documented_number(proxied, operation, call):
    client, bucket, proxy = proxied
    s3.put_bytes(f"{bucket}/k", b"x", client)
    proxy.throttle(operation, 100)
    with pytest.raises(StorageError):
        call(client, bucket)
    sent = [op for op, _ in proxy.throttled()].count(operation)
    assert sent == s3.MAX_ATTEMPTS
    assert _documented_attempts() == {s3.MAX_ATTEMPTS}


@pytest.mark.parametrize("operation,call,what", [
    ("PutObject", lambda c, b, f: s3.put_bytes(f"{b}/x/meta.json", b"{}", c), "put"),
    ("HeadObject", lambda c, b, f: s3.size_of(f"{b}/x/meta.json", c), "head"),
    ("PutObject", lambda c, b, f: s3.upload_file(f, f"{b}/x/meta.json", c), "upload to"),
    ("ListObjectsV2", lambda c, b, f: s3.list_files(f"{b}/x", c), "list"),
])
def test_a_throttled_request_says_it_was_throttled_how_often_and_how_long(
        proxied, tmp_path, operation, call, what):
    client, bucket, proxy = proxied
    local = tmp_path / "meta.json"
    local.write_bytes(b"{}")
    proxy.throttle(operation, 100)
    with pytest.raises(StorageError) as caught:
        call(client, bucket, local)
    message = str(caught.value)
    assert re.search(rf"S3 {what} {bucket}/x(/meta.json)? failed: throttled "
                     rf"{s3.MAX_ATTEMPTS} times over \d+\.\d s \(last answer ", message), message
    assert "limits the request rate" in message
    assert "credentials" not in message and "check the URI" not in message
    assert caught.value.throttled == s3.MAX_ATTEMPTS
    assert caught.value.remedy == THROTTLE_REMEDY


def test_other_failures_keep_the_store_s_answer_and_no_throttling_remedy(proxied):
    client, bucket, _ = proxied
    with pytest.raises(StorageError) as caught:
        s3.put_bytes(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/k", b"x", client)
    assert "NoSuchBucket" in str(caught.value)
    assert caught.value.throttled == 0 and caught.value.remedy == ""
