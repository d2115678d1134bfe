"""S3 behind the storage interface (boto3): bounded timeouts, retries with back-off, multipart
transfers. Used for checkpoints and datasets by the trainer and for prepared datasets by data
preparation.

Credentials come from the session a caller hands to :func:`make_client` (data preparation: the
Airflow connection's), else boto3's standard chain (environment, ``~/.aws``, instance or pod role);
the endpoint of an S3-compatible store from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``. The
``train`` task sets ``AWS_ENDPOINT_URL_S3`` from the spec's endpoint on every engine and, with
the ``local`` and ``ray`` engines, puts the keys of the spec's Airflow connection
(``storage.aws_conn_id``) into the ranks' environment; so do the validation and registration
tasks for the validator and the exporter. This module never sees Airflow.

boto3 is imported on the first client: importing this module (e.g. at DAG-parse time) is cheap.

Every request is retried by botocore's `RETRY_MODE` (``standard``) mode, up to `MAX_ATTEMPTS`
attempts, with truncated exponential back-off and full jitter; each attempt has
`CONNECT_TIMEOUT_S` / `READ_TIMEOUT_S`; files above `MULTIPART_BYTES` move in multipart parts,
each retried on its own; a throttled call says so (:mod:`trainforge.storage.s3_errors`). The
back-off in full, and why not ``adaptive``: docs/storage.md, "Credentials and endpoint".
Checksums only where S3 requires them (:data:`CHECKSUM_ENV` overrides): docs/storage.md,
"Checksums and S3-compatible stores".

S3 has no rename: a checkpoint or dataset exists once its ``manifest.json`` object is written,
which is why the manifest is always put last (`S3Storage.publish`, then `S3Storage.write_bytes`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any

from trainforge.contract import split_s3_uri
from trainforge.storage.base import Location, StorageError
from trainforge.storage.s3_errors import (
    THROTTLE_COUNTERS,
    ThrottleCounter,
    is_missing,
    s3_errors,
)

CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
RETRY_MODE = "standard"  # botocore retry mode (module doc)
MAX_ATTEMPTS = 8  # attempts per request, the first included
MULTIPART_BYTES = 8 << 20
#: botocore's checksum settings (Config field: environment variable); unset, ``when_required``.
CHECKSUM_ENV = {"request_checksum_calculation": "AWS_REQUEST_CHECKSUM_CALCULATION",
                "response_checksum_validation": "AWS_RESPONSE_CHECKSUM_VALIDATION"}
# How long an object this product has just PUT may keep answering 404 on an S3-compatible store
# whose reads lag its writes (AWS S3 itself is strongly consistent since 2020); see
# trainforge.storage.settle. TRAINFORGE_S3_SETTLE_S overrides it.
SETTLE_S = 30.0
HASH_CHUNK_BYTES = 4 << 20
_CLIENTS: dict[str | None, Any] = {}
_LOCK = threading.Lock()


def is_s3(uri: Any) -> bool:
    """True for ``s3://...`` strings (a ``Path`` never is: it would have eaten one slash)."""
    return isinstance(uri, str) and uri.startswith("s3://")


def split(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``("bucket", "key")``. Raises StorageError for anything else."""
    parts = split_s3_uri(uri)
    if parts is None:
        raise StorageError(uri, "parse", "expected s3://bucket/key")
    return parts


def join(uri: str, *parts: str) -> str:
    """``join("s3://b/root/", "step-1", "x")`` -> ``"s3://b/root/step-1/x"``."""
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def endpoint_url() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def make_client(endpoint: str | None = None, session: Any = None) -> Any:
    """A new boto3 S3 client with this module's timeouts and retries (module doc).

    ``session``: a ``boto3.session.Session`` holding the credentials to use (an Airflow
    connection's, ``trainforge.hooks.s3``); default a new one on boto3's standard chain.
    ``endpoint``: an S3-compatible endpoint URL; default boto3's (``AWS_ENDPOINT_URL*``, AWS).
    """
    import boto3  # heavy: loaded by the first client, not at import
    from botocore.config import Config

    checksums = {field: os.environ.get(env) or "when_required"
                 for field, env in CHECKSUM_ENV.items()}
    config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                    retries={"total_max_attempts": MAX_ATTEMPTS, "mode": RETRY_MODE},
                    **checksums)
    session = session if session is not None else boto3.session.Session()
    made = session.client("s3", endpoint_url=endpoint, config=config)
    if checksums["request_checksum_calculation"] == "when_required":
        made.meta.events.register("before-sign.s3.DeleteObjects", _content_md5_instead)
    counter = ThrottleCounter()
    made.meta.events.register("needs-retry.s3", counter)
    THROTTLE_COUNTERS[made] = counter
    return made


def _content_md5_instead(request: Any, **_: Any) -> None:
    """DeleteObjects with the ``Content-MD5`` that S3 required before the flexible checksums
    (and stores that predate them still do) instead of botocore's ``x-amz-checksum-*``."""
    import base64

    body = request.body or b""
    body = body.encode() if isinstance(body, str) else body
    if not isinstance(body, bytes):
        return  # a stream: leave botocore's checksum (DeleteObjects bodies are bytes)
    for name in [h for h in request.headers if h.lower().startswith(
            ("x-amz-checksum-", "x-amz-sdk-checksum-algorithm"))]:
        del request.headers[name]
    request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()


def client() -> Any:
    """The process's S3 client for the endpoint in the environment (created once per endpoint)."""
    endpoint = endpoint_url()
    with _LOCK:
        if endpoint not in _CLIENTS:
            _CLIENTS[endpoint] = make_client(endpoint)
        return _CLIENTS[endpoint]


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig  # heavy (module doc)

    return TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES,
                          max_concurrency=4)


def upload_file(path: str | os.PathLike, uri: str, using: Any = None) -> None:
    """Upload a local file, multipart above `MULTIPART_BYTES` (module doc: retries)."""
    bucket, key = split(uri)
    c = using or client()
    with s3_errors(uri, "upload to", c):  # boto3 wraps part failures in S3UploadFailedError
        c.upload_file(str(path), bucket, key, Config=_transfer_config())


def download_file(uri: str, path: str | os.PathLike, using: Any = None) -> None:
    """Download an object to a local file, multipart above `MULTIPART_BYTES`."""
    bucket, key = split(uri)
    c = using or client()
    with s3_errors(uri, "download", c):
        c.download_file(bucket, key, str(path), Config=_transfer_config())


def put_bytes(uri: str, data: bytes, using: Any = None) -> None:
    """One PutObject: readers see the old object or the whole new one."""
    bucket, key = split(uri)
    c = using or client()
    with s3_errors(uri, "put", c):
        c.put_object(Bucket=bucket, Key=key, Body=data)


def get_bytes(uri: str, using: Any = None) -> bytes | None:
    """The object's bytes, or None when it does not exist."""
    bucket, key = split(uri)
    c = using or client()
    with s3_errors(uri, "get", c):
        try:
            return c.get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as err:
            if is_missing(err):
                return None
            raise


def size_of(uri: str, using: Any = None) -> int | None:
    """The object's size in bytes, or None when it does not exist."""
    bucket, key = split(uri)
    c = using or client()
    with s3_errors(uri, "head", c):
        try:
            return int(c.head_object(Bucket=bucket, Key=key)["ContentLength"])
        except Exception as err:
            if is_missing(err):
                return None
            raise


def sha256(uri: str, using: Any = None) -> str:
    """SHA-256 hex of an object, streamed in `HASH_CHUNK_BYTES` reads."""
    bucket, key = split(uri)
    digest = hashlib.sha256()
    c = using or client()
    with s3_errors(uri, "read", c):
        body = c.get_object(Bucket=bucket, Key=key)["Body"]
        for chunk in body.iter_chunks(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def list_keys(prefix_uri: str, using: Any = None) -> Iterator[str]:
    """Every key under ``prefix_uri`` (all pages: S3 returns at most 1000 per page)."""
    bucket, prefix = split(prefix_uri)
    c = using or client()
    with s3_errors(prefix_uri, "list", c):
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", ()):
                yield item["Key"]


def list_children(prefix_uri: str, using: Any = None) -> list[str]:
    """The names of the "folders" directly under ``prefix_uri`` (all pages), sorted."""
    return _list_level(prefix_uri, using)[0]


def list_files(prefix_uri: str, using: Any = None) -> list[str]:
    """The names of the objects directly under ``prefix_uri`` (all pages), sorted."""
    return _list_level(prefix_uri, using)[1]


def _list_level(prefix_uri: str, using: Any) -> tuple[list[str], list[str]]:
    """``(folder names, object names)`` one level under ``prefix_uri`` (delimiter listing)."""
    bucket, prefix = split(prefix_uri.rstrip("/") + "/")
    dirs, files = [], []
    c = using or client()
    with s3_errors(prefix_uri, "list", c):
        pages = c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
        for page in pages:
            dirs += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", ())]
            files += [o["Key"][len(prefix):] for o in page.get("Contents", ()) if o["Key"] != prefix]
    return sorted(dirs), sorted(files)


def copy(src_uri: str, dst_uri: str, using: Any = None) -> None:
    """Server-side copy (multipart above `MULTIPART_BYTES`)."""
    src_bucket, src_key = split(src_uri)
    bucket, key = split(dst_uri)
    c = using or client()
    with s3_errors(src_uri, f"copy to {dst_uri}", c):
        c.copy({"Bucket": src_bucket, "Key": src_key}, bucket, key, Config=_transfer_config())


def delete_keys(bucket_uri: str, keys: list[str], using: Any = None) -> None:
    """Delete ``keys`` of the bucket of ``bucket_uri``, 1000 per DeleteObjects call."""
    bucket, _ = split(bucket_uri)
    for lo in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[lo:lo + 1000]]
        c = using or client()
        with s3_errors(bucket_uri, "delete", c):
            out = c.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        if out.get("Errors"):
            first = out["Errors"][0]
            raise StorageError(f"s3://{bucket}/{first.get('Key')}", "delete",
                          f"{first.get('Code')}: {first.get('Message')} ({len(out['Errors'])} keys failed)")


def delete_prefix(prefix_uri: str, using: Any = None) -> int:
    """Delete every object under ``prefix_uri``; returns how many."""
    keys = list(list_keys(prefix_uri.rstrip("/") + "/", using))
    delete_keys(prefix_uri, keys, using)
    return len(keys)


class S3Storage:
    """`trainforge.storage.base.Storage` on S3; locations are ``s3://bucket/key`` strings.

    ``client_source``: returns the boto3 client to use, called on first use (data preparation
    hands in one made from an Airflow connection's session); default `client`, this process's
    client for the environment's endpoint. ``settle_s``: the store's read-after-write lag
    budget (`SETTLE_S`, or ``TRAINFORGE_S3_SETTLE_S``).
    """

    def __init__(self, client_source: Callable[[], Any] = client,
                 settle_s: float | None = None) -> None:
        self._client_source = client_source
        if settle_s is None:
            settle_s = float(os.environ.get("TRAINFORGE_S3_SETTLE_S") or SETTLE_S)
        self.settle_s = settle_s

    @cached_property
    def _client(self) -> Any:
        return self._client_source()

    def join(self, base: Location, *names: str) -> str:
        return join(str(base), *names)

    def name(self, location: Location) -> str:
        return str(location).rstrip("/").rsplit("/", 1)[-1]

    def parent(self, location: Location) -> str:
        return str(location).rstrip("/").rsplit("/", 1)[0]

    def absolute(self, location: Location) -> str:
        return str(location)

    def local_path(self, location: Location) -> None:
        return None

    def list_dirs(self, location: Location) -> list[str]:
        return list_children(str(location), self._client)

    def list_files(self, location: Location) -> list[str]:
        return list_files(str(location), self._client)

    def is_dir(self, location: Location) -> bool:
        bucket, prefix = split(str(location).rstrip("/") + "/")
        with s3_errors(str(location), "list", self._client):
            listed = self._client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
        return bool(listed.get("KeyCount") or listed.get("Contents"))

    def size(self, location: Location) -> int | None:
        return size_of(str(location), self._client)

    def read_bytes(self, location: Location) -> bytes | None:
        return get_bytes(str(location), self._client)

    def sha256(self, location: Location) -> str:
        return sha256(str(location), self._client)

    def write_bytes(self, location: Location, data: bytes) -> None:
        """One PutObject (atomic on S3)."""
        put_bytes(str(location), data, self._client)

    def put_file(self, path: Path, location: Location) -> None:
        upload_file(path, str(location), self._client)

    def get_file(self, location: Location, path: Path) -> None:
        download_file(str(location), path, self._client)

    @contextmanager
    def staging_dir(self, location: Location) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="trainforge-stage-") as tmp:
            folder = Path(tmp) / self.name(location)
            folder.mkdir()
            yield folder

    def publish(self, folder: Path, location: Location, names: Sequence[str]) -> None:
        for name in names:
            self.put_file(folder / name, self.join(location, name))

    @contextmanager
    def local_dir(self, location: Location, names: Sequence[str]) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="trainforge-fetch-") as tmp:
            folder = Path(tmp) / self.name(location)
            folder.mkdir()
            for name in names:
                uri = self.join(location, name)
                if Path(name).name == name and self.size(uri) is not None:
                    self.get_file(uri, folder / name)
            yield folder

    def move_dir(self, src: Location, dst: Location, first: str) -> None:
        """Copy every object, then delete the originals, ``first`` before the rest."""
        bucket, prefix = split(str(src).rstrip("/") + "/")
        keys = list(list_keys(f"s3://{bucket}/{prefix}", self._client))
        for key in keys:
            copy(f"s3://{bucket}/{key}", self.join(dst, key[len(prefix):]), self._client)
        self._delete_first(str(src), keys, prefix + first)

    def delete_dir(self, location: Location, first: str) -> int:
        bucket, prefix = split(str(location).rstrip("/") + "/")
        keys = list(list_keys(f"s3://{bucket}/{prefix}", self._client))
        self._delete_first(str(location), keys, prefix + first)
        return len(keys)

    def _delete_first(self, uri: str, keys: list[str], first_key: str) -> None:
        delete_keys(uri, [k for k in keys if k == first_key], self._client)  # stops existing first
        delete_keys(uri, [k for k in keys if k != first_key], self._client)
