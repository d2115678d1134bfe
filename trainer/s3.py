"""S3 access for checkpoints (boto3): bounded timeouts, retries with back-off, multipart transfers.

Credentials come from boto3's standard chain (environment, ``~/.aws``, instance or pod role);
the endpoint of an S3-compatible store from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``. The
``train`` task sets ``AWS_ENDPOINT_URL_S3`` from the spec's endpoint on every engine and, with
the ``local`` and ``ray`` engines, puts the keys of the spec's Airflow connection
(``storage.aws_conn_id``) into the ranks' environment; so do the validation and registration
tasks for the validator and the exporter. This module never sees Airflow.

Retries: every request is retried by botocore's `RETRY_MODE` (``standard``) mode, up to
`MAX_ATTEMPTS` attempts in all, on throttling answers (``503 SlowDown``, ``429``, throttling
error codes), other 5xx answers and connection errors. The wait before attempt ``i + 1`` is
``rand(0, 1) * min(scale * 2**i, 20 s)`` with ``scale`` 1 s after throttling and 50 ms otherwise
(botocore.retries.standard.ExponentialBackoff: truncated binary exponential back-off with full
jitter), so 8 attempts wait at most about 1 + 2 + 4 + 8 + 16 + 20 + 20 s. ``adaptive`` mode
would add a client-side token bucket that slows every later request of the process once it was
throttled; it suits clients that flood a bucket with small requests, not a checkpoint's few
large ones, so ``standard`` is used. Each attempt has `CONNECT_TIMEOUT_S` / `READ_TIMEOUT_S`. Files above
`MULTIPART_BYTES` go up and down in multipart transfers of `MULTIPART_BYTES` parts, each part a
request retried on its own.

S3 has no rename: a checkpoint exists once its ``manifest.json`` object is written, which is
why the manifest is always uploaded last (trainforge.trainer.checkpoint_s3).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from trainforge.trainer.errors import CheckpointError

CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
RETRY_MODE = "standard"  # botocore retry mode (module doc)
MAX_ATTEMPTS = 8  # attempts per request, the first included
MULTIPART_BYTES = 8 << 20
HASH_CHUNK_BYTES = 4 << 20
_URI = re.compile(r"^s3://([^/]+)/?(.*)$")
_CLIENTS: dict[str | None, Any] = {}
_LOCK = threading.Lock()


class S3Error(CheckpointError):
    """An S3 call failed after botocore's retries (exit code 1: transient, the task retries)."""

    def __init__(self, uri: str, operation: str, cause: str) -> None:
        self.uri, self.operation, self.cause = uri, operation, cause
        super().__init__(f"S3 {operation} {uri} failed: {cause}")


def is_s3(uri: Any) -> bool:
    """True for ``s3://...`` strings (a ``Path`` never is: it would have eaten one slash)."""
    return isinstance(uri, str) and uri.startswith("s3://")


def split(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``("bucket", "key")``. Raises S3Error for anything else."""
    match = _URI.match(uri)
    if not match:
        raise S3Error(uri, "parse", "expected s3://bucket/key")
    return match.group(1), match.group(2)


def join(uri: str, *parts: str) -> str:
    """``join("s3://b/root/", "step-1", "x")`` -> ``"s3://b/root/step-1/x"``."""
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def endpoint_url() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def client() -> Any:
    """The process's S3 client for the current endpoint (created once per endpoint)."""
    endpoint = endpoint_url()
    with _LOCK:
        if endpoint not in _CLIENTS:
            import boto3
            from botocore.config import Config

            config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                            retries={"total_max_attempts": MAX_ATTEMPTS, "mode": RETRY_MODE})
            _CLIENTS[endpoint] = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
        return _CLIENTS[endpoint]


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES,
                          max_concurrency=4)


def _cause(err: Exception) -> str:
    response = getattr(err, "response", None) or {}
    error = response.get("Error") or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    if error:
        return f"{error.get('Code')} (HTTP {status}): {error.get('Message', '')}".strip()
    return f"{type(err).__name__}: {err}"


def _missing(err: Exception) -> bool:
    error = (getattr(err, "response", None) or {}).get("Error") or {}
    return str(error.get("Code")) in ("NoSuchKey", "404", "NotFound")


def upload_file(path: str | os.PathLike, uri: str) -> None:
    """Upload a local file, multipart above `MULTIPART_BYTES` (module doc: retries)."""
    bucket, key = split(uri)
    try:
        client().upload_file(str(path), bucket, key, Config=_transfer_config())
    except Exception as err:  # boto3 wraps part failures in S3UploadFailedError
        raise S3Error(uri, "upload to", _cause(err)) from err


def download_file(uri: str, path: str | os.PathLike) -> None:
    """Download an object to a local file, multipart above `MULTIPART_BYTES`."""
    bucket, key = split(uri)
    try:
        client().download_file(bucket, key, str(path), Config=_transfer_config())
    except Exception as err:
        raise S3Error(uri, "download", _cause(err)) from err


def put_bytes(uri: str, data: bytes) -> None:
    """One PutObject: readers see the old object or the whole new one."""
    bucket, key = split(uri)
    try:
        client().put_object(Bucket=bucket, Key=key, Body=data)
    except Exception as err:
        raise S3Error(uri, "put", _cause(err)) from err


def get_bytes(uri: str) -> bytes | None:
    """The object's bytes, or None when it does not exist."""
    bucket, key = split(uri)
    try:
        return client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as err:
        if _missing(err):
            return None
        raise S3Error(uri, "get", _cause(err)) from err


def size_of(uri: str) -> int | None:
    """The object's size in bytes, or None when it does not exist."""
    bucket, key = split(uri)
    try:
        return int(client().head_object(Bucket=bucket, Key=key)["ContentLength"])
    except Exception as err:
        if _missing(err):
            return None
        raise S3Error(uri, "head", _cause(err)) from err


def sha256(uri: str) -> str:
    """SHA-256 hex of an object, streamed in `HASH_CHUNK_BYTES` reads."""
    bucket, key = split(uri)
    digest = hashlib.sha256()
    try:
        body = client().get_object(Bucket=bucket, Key=key)["Body"]
        for chunk in body.iter_chunks(HASH_CHUNK_BYTES):
            digest.update(chunk)
    except Exception as err:
        raise S3Error(uri, "read", _cause(err)) from err
    return digest.hexdigest()


def list_keys(prefix_uri: str) -> Iterator[str]:
    """Every key under ``prefix_uri`` (all pages: S3 returns at most 1000 per page)."""
    bucket, prefix = split(prefix_uri)
    try:
        for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", ()):
                yield item["Key"]
    except Exception as err:
        raise S3Error(prefix_uri, "list", _cause(err)) from err


def list_children(prefix_uri: str) -> list[str]:
    """The names of the "folders" directly under ``prefix_uri`` (all pages), sorted."""
    bucket, prefix = split(prefix_uri.rstrip("/") + "/")
    names = []
    try:
        pages = client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
        for page in pages:
            names += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", ())]
    except Exception as err:
        raise S3Error(prefix_uri, "list", _cause(err)) from err
    return sorted(names)


def copy(src_uri: str, dst_uri: str) -> None:
    """Server-side copy (multipart above `MULTIPART_BYTES`)."""
    src_bucket, src_key = split(src_uri)
    bucket, key = split(dst_uri)
    try:
        client().copy({"Bucket": src_bucket, "Key": src_key}, bucket, key, Config=_transfer_config())
    except Exception as err:
        raise S3Error(src_uri, f"copy to {dst_uri}", _cause(err)) from err


def delete_keys(bucket_uri: str, keys: list[str]) -> None:
    """Delete ``keys`` of the bucket of ``bucket_uri``, 1000 per DeleteObjects call."""
    bucket, _ = split(bucket_uri)
    for lo in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[lo:lo + 1000]]
        try:
            out = client().delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        except Exception as err:
            raise S3Error(bucket_uri, "delete", _cause(err)) from err
        if out.get("Errors"):
            first = out["Errors"][0]
            raise S3Error(f"s3://{bucket}/{first.get('Key')}", "delete",
                          f"{first.get('Code')}: {first.get('Message')} ({len(out['Errors'])} keys failed)")


def delete_prefix(prefix_uri: str) -> int:
    """Delete every object under ``prefix_uri``; returns how many."""
    keys = list(list_keys(prefix_uri.rstrip("/") + "/"))
    delete_keys(prefix_uri, keys)
    return len(keys)
