"""A lagging S3 client for tests (no tests here): reads of an object answer 404, as some
S3-compatible stores do, for ``lag_s`` seconds after the object was written.

:class:`ReadAfterWriteLag` hooks into a real boto3 client (in front of the session's moto
server): it notes the time of every PutObject / CompleteMultipartUpload / CopyObject of a key,
and for ``lag_s`` after it answers that key's HeadObject and GetObject with S3's own 404
(``NoSuchKey``; ``404`` for HEAD) without sending them. Everything else goes to the server.
``hidden`` counts the reads answered so.
"""

from __future__ import annotations

import threading
import time
from typing import Any

WRITES = ("PutObject", "CompleteMultipartUpload", "CopyObject")
READS = ("HeadObject", "GetObject")


class _Answer:
    """The part of an HTTP response botocore looks at when a handler answers for the server."""

    status_code = 404
    headers: dict[str, str] = {}
    raw = None
    content = b""


class ReadAfterWriteLag:
    def __init__(self, client: Any, lag_s: float) -> None:
        self.client, self.lag_s = client, lag_s
        self.written: dict[tuple[str, str], float] = {}
        self.hidden: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        events = client.meta.events
        events.register("before-parameter-build.s3", self._note_key)
        events.register("before-call.s3", self._answer)

    def close(self) -> None:
        events = self.client.meta.events
        events.unregister("before-parameter-build.s3", self._note_key)
        events.unregister("before-call.s3", self._answer)

    def _note_key(self, params: dict, model: Any, context: dict, **_: Any) -> None:
        key = (params.get("Bucket", ""), params.get("Key", ""))
        context["lag_key"] = key
        if model.name in WRITES:
            with self._lock:
                self.written[key] = time.monotonic()

    def _answer(self, model: Any, context: dict, **_: Any):
        if model.name not in READS:
            return None
        key = context.get("lag_key")
        with self._lock:
            at = self.written.get(key)
            if at is None or time.monotonic() - at >= self.lag_s:
                return None
            self.hidden.append((model.name, key[1]))
        code = "404" if model.name == "HeadObject" else "NoSuchKey"
        return _Answer(), {"Error": {"Code": code, "Message": "Not Found"},
                           "ResponseMetadata": {"HTTPStatusCode": 404, "HTTPHeaders": {}}}
