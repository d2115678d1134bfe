"""S3 sources of data preparation: list (paginated, glob patterns), streamed and ranged reads
that pin the object version by ETag. Outputs go through the storage interface
(:mod:`trainforge.storage`), and so does the client: :func:`trainforge.storage.s3.make_client`
(its bounded timeouts and retries), with the credentials of the session it is given (the
Airflow connection named by ``storage.aws_conn_id``), else boto3's standard chain (environment,
``~/.aws``, instance or pod role); never from the spec. The endpoint is the spec's
``data.s3_endpoint_url`` when given, else boto3's own ``AWS_ENDPOINT_URL`` handling, else AWS.

Every read passes ``IfMatch=<ETag seen when listing>``: an object replaced while the dataset is
being prepared fails with :class:`SourceChangedError` instead of mixing two versions. A streamed
read that loses its connection resumes at the byte it reached (``Range``), up to
``STREAM_RESUMES`` times.
"""

from __future__ import annotations

import io
import logging
import re
from dataclasses import dataclass
from typing import Any

from trainforge.contract import split_s3_uri
from trainforge.data.errors import SourceAccessError, SourceChangedError

logger = logging.getLogger(__name__)

#: Times a broken streamed read is re-opened where it stopped before the error is raised.
STREAM_RESUMES = 5
_MAGIC = re.compile(r"[*?\[]")


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)``.

    Raises:
        SourceAccessError: not an ``s3://bucket/...`` URI.
    """
    parts = split_s3_uri(uri)
    if parts is None:
        raise SourceAccessError(uri, "parse", "not an s3://bucket/key URI",
                                "write S3 locations as s3://bucket/prefix/...")
    return parts


@dataclass(frozen=True)
class S3Object:
    bucket: str
    key: str
    size: int
    etag: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A key pattern as a regex with glob semantics: ``*``, ``?`` and ``[...]`` stay inside one
    ``/``-separated segment; a whole ``**`` segment matches any number of segments."""
    parts = pattern.split("/")
    out = ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out += ".*" if last else "(?:[^/]+/)*"
            continue
        out += _segment_regex(part)
        if not last:
            out += "/"
    return re.compile(out + r"\Z", re.DOTALL)


def _segment_regex(part: str) -> str:
    """Translate one glob segment; no wildcard crosses ``/``."""
    out, i = "", 0
    while i < len(part):
        c = part[i]
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[" and (end := part.find("]", i + (2 if part[i + 1:i + 2] in "!]" else 1))) > 0:
            body = part[i + 1:end]
            body = "^" + body[1:] if body.startswith("!") else body
            out += "[" + body.replace("\\", "\\\\") + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return out


def fixed_prefix(key_pattern: str) -> str:
    """The key prefix before the segment holding the first wildcard (listing starts there)."""
    match = _MAGIC.search(key_pattern)
    if not match:
        return key_pattern
    return key_pattern[:key_pattern.rfind("/", 0, match.start()) + 1]


def list_matching(client: Any, uri_pattern: str) -> list[S3Object]:
    """Every object matching ``s3://bucket/key-glob`` (folder markers ``.../`` skipped), in key
    order. Lists with ListObjectsV2 from the pattern's fixed prefix, following every page.

    Raises:
        SourceAccessError: the bucket cannot be listed.
    """
    bucket, pattern = split_uri(uri_pattern)
    regex = glob_regex(pattern)
    prefix = fixed_prefix(pattern)
    found: list[S3Object] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", ()):
                key = item["Key"]
                if not key.endswith("/") and regex.match(key):
                    found.append(S3Object(bucket, key, int(item["Size"]), item["ETag"]))
    except Exception as err:  # botocore ClientError, NoCredentialsError, EndpointConnectionError
        raise SourceAccessError(f"s3://{bucket}/{prefix}", "list", _describe(err)) from err
    logger.info("listed s3://%s/%s: %d objects match %s", bucket, prefix, len(found), pattern)
    return sorted(found, key=lambda o: o.key)


def _describe(err: Exception) -> str:
    response = getattr(err, "response", None)
    if isinstance(response, dict) and "Error" in response:
        e = response["Error"]
        return f"{e.get('Code', '?')}: {e.get('Message', '')}".strip()
    return f"{type(err).__name__}: {err}"


def _error_code(err: Exception) -> str:
    response = getattr(err, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _get(client: Any, obj: S3Object, range_header: str | None) -> Any:
    kwargs: dict[str, Any] = {"Bucket": obj.bucket, "Key": obj.key, "IfMatch": obj.etag}
    if range_header:
        kwargs["Range"] = range_header
    try:
        return client.get_object(**kwargs)["Body"]
    except Exception as err:
        if _error_code(err) in ("PreconditionFailed", "412"):
            raise SourceChangedError(obj.uri, obj.etag, "a new ETag") from err
        raise SourceAccessError(obj.uri, "read", _describe(err)) from err


class S3StreamReader(io.RawIOBase):
    """Sequential reader of one object; resumes a broken stream where it stopped."""

    def __init__(self, client: Any, obj: S3Object) -> None:
        super().__init__()
        self.client, self.obj = client, obj
        self.pos = 0
        self._body = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.pos >= self.obj.size:
            return 0
        view = memoryview(buffer).cast("B")
        for attempt in range(STREAM_RESUMES + 1):
            try:
                if self._body is None:
                    self._body = _get(self.client, self.obj,
                                      f"bytes={self.pos}-" if self.pos else None)
                data = self._body.read(len(view))
                break
            except (SourceChangedError, SourceAccessError):
                raise
            except Exception as err:  # connection reset, read timeout, incomplete read
                self._close_body()
                if attempt == STREAM_RESUMES:
                    raise SourceAccessError(self.obj.uri, "read",
                                            f"{_describe(err)} at byte {self.pos}") from err
                logger.warning("s3 read of %s broke at byte %d (%s); resuming", self.obj.uri,
                               self.pos, _describe(err))
        n = len(data)
        view[:n] = data
        self.pos += n
        if n == 0 and self.pos < self.obj.size:
            raise SourceAccessError(self.obj.uri, "read",
                                    f"stream ended at byte {self.pos} of {self.obj.size}")
        return n

    def _close_body(self) -> None:
        if self._body is not None:
            try:
                self._body.close()
            except Exception:  # noqa: BLE001 - closing a broken stream
                pass
            self._body = None

    def close(self) -> None:
        self._close_body()
        super().close()


class S3RangeReader(io.RawIOBase):
    """Seekable reader (one ranged GET per read) for formats that need random access: Parquet
    reads its footer, then only the column chunks it needs."""

    def __init__(self, client: Any, obj: S3Object) -> None:
        super().__init__()
        self.client, self.obj = client, obj
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.obj.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self.obj.size, self.pos + len(view))
        if end <= self.pos:
            return 0
        body = _get(self.client, self.obj, f"bytes={self.pos}-{end - 1}")
        try:
            data = body.read()
        except Exception as err:
            raise SourceAccessError(self.obj.uri, "read", _describe(err)) from err
        finally:
            body.close()
        view[:len(data)] = data
        self.pos += len(data)
        return len(data)


def read_bytes(client: Any, uri: str) -> bytes:
    """A whole small object (a manifest, a tokenizer).

    Raises:
        SourceAccessError: missing or unreadable.
    """
    bucket, key = split_uri(uri)
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as err:
        raise SourceAccessError(uri, "read", _describe(err)) from err


def read_optional(client: Any, uri: str) -> bytes | None:
    """A whole small object, or None when it does not exist (a model folder's optional file).

    Raises:
        SourceAccessError: it exists but cannot be read.
    """
    bucket, key = split_uri(uri)
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as err:
        if _error_code(err) in ("NoSuchKey", "404", "NotFound"):
            return None
        raise SourceAccessError(uri, "read", _describe(err)) from err
