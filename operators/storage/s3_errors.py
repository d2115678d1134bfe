"""What an S3 failure says: the store's own answer, and for throttling how often and for how long
it throttled ("throttled N times over T s") with what to do, never a hint at URIs or credentials.

:func:`s3_errors` wraps each S3 call of :mod:`trainforge.storage.s3`; :class:`ThrottleCounter`
counts a client's throttling answers, every retry included.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from trainforge.storage.base import StorageError


# Error codes of a throttling answer (botocore.retries.standard's list) and the HTTP statuses
# S3 throttles with (503 SlowDown, also on HEAD where there is no body to carry the code; 429
# from S3-compatible stores).
THROTTLE_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "ProvisionedThroughputExceededException",
    "TransactionInProgressException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "LimitExceededException", "RequestThrottled", "SlowDown", "PriorRequestNotComplete",
    "EC2ThrottledException",
})
THROTTLE_STATUSES = frozenset({429, 503})
THROTTLE_REMEDY = ("the store limits the request rate under this prefix; the task's retry tries "
                   "again later, or lower the rate (fewer ranks or jobs writing to the bucket at "
                   "once, a checkpoint less often)")


def is_throttling(code: Any, status: Any) -> bool:
    """Whether an S3 answer (error code, HTTP status) says "slow down"."""
    return str(code) in THROTTLE_CODES or status in THROTTLE_STATUSES


class ThrottleCounter:
    """Counts a client's throttling answers, every attempt included (botocore's ``needs-retry``
    event, emitted after each attempt before the retry decision)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, response: Any = None, **_: Any) -> None:
        if response is None:  # no answer (connection error)
            return None
        http, parsed = response
        code = ((parsed or {}).get("Error") or {}).get("Code")
        if is_throttling(code, getattr(http, "status_code", None)):
            with self._lock:
                self.count += 1
        return None  # no opinion: botocore's retry handler decides


THROTTLE_COUNTERS: weakref.WeakKeyDictionary[Any, ThrottleCounter] = weakref.WeakKeyDictionary()
"""The counter of each client :func:`trainforge.storage.s3.make_client` made."""


def _response(err: BaseException) -> dict[str, Any]:
    """The S3 answer behind ``err``, also when a transfer wrapped it (S3UploadFailedError)."""
    seen: BaseException | None = err
    for _ in range(5):
        if seen is None:
            break
        response = getattr(seen, "response", None)
        if response:
            return response
        seen = seen.__cause__ or seen.__context__
    return {}


def _cause(err: Exception) -> str:
    response = _response(err)
    error = response.get("Error") or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    if error:
        return f"{error.get('Code')} (HTTP {status}): {error.get('Message', '')}".strip()
    return f"{type(err).__name__}: {err}"


def is_missing(err: Exception) -> bool:
    """Whether ``err`` is S3's answer that the object does not exist."""
    error = (getattr(err, "response", None) or {}).get("Error") or {}
    return str(error.get("Code")) in ("NoSuchKey", "404", "NotFound")


def _error(uri: str, operation: str, err: Exception, elapsed_s: float,
           throttled: int | None) -> StorageError:
    """A StorageError for ``err``; when the store's last answer was throttling, one that says
    so: "throttled N times over T s" (N counted on the client, else the attempts the last
    request made) and what to do, not a hint at URIs or credentials."""
    response = _response(err)
    code = (response.get("Error") or {}).get("Code")
    meta = response.get("ResponseMetadata") or {}
    if response and is_throttling(code, meta.get("HTTPStatusCode")):
        times = throttled or int(meta.get("RetryAttempts") or 0) + 1
        return StorageError(uri, operation,
                            f"throttled {times} times over {elapsed_s:.1f} s (last answer "
                            f"{_cause(err)})", throttled=times, remedy=THROTTLE_REMEDY)
    return StorageError(uri, operation, _cause(err))


@contextmanager
def s3_errors(uri: str, operation: str, using: Any) -> Iterator[None]:
    """Turn what the S3 call in the block raises into a :class:`StorageError` (:func:`_error`),
    timing the call and counting its throttling answers."""
    counter = THROTTLE_COUNTERS.get(using)
    before = counter.count if counter else 0
    started = time.monotonic()
    try:
        yield
    except StorageError:
        raise
    except Exception as err:  # boto3 and s3transfer raise many types
        throttled = counter.count - before if counter else None
        raise _error(uri, operation, err, time.monotonic() - started, throttled) from err
