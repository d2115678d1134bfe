"""Rank 0's log through the API server's pod log endpoint, read in chunks that resume.

Offsets are the kubelet's timestamp of the last line passed on, in nanoseconds since the epoch
(0: from the start): lines are asked for with ``timestamps=true`` and ``sinceTime`` (whole
seconds), and lines not newer than the offset are dropped. Two lines with the same nanosecond
timestamp at a chunk boundary would lose the second one.
"""

from __future__ import annotations

import calendar
import time
from typing import Any

from trainforge.engines.base import LogChunk
from trainforge.engines.kubernetes.client import api_error, network_errors
from trainforge.errors import BackendError


def log_ts_ns(stamp: str) -> int | None:
    """The kubelet's log timestamp (RFC 3339 with nanoseconds) → nanoseconds since the epoch."""
    base, _, frac = stamp.rstrip("Z").partition(".")
    try:
        whole = calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
    digits = (frac if frac.isdigit() else "")[:9].ljust(9, "0")
    return whole * 1_000_000_000 + int(digits)


def read_log(api: Any, namespace: str, pod: str, container: str, offset: int, max_bytes: int,
             request_timeout_s: float) -> LogChunk:
    """Lines of ``container`` in ``pod`` after ``offset`` (at most ``max_bytes`` of them);
    ``api`` is the client's ``ApiClient``.

    Raises:
        BackendError: the API cannot be reached or refuses (a container that has not started,
            or a pod just replaced, is an empty chunk instead).
    """
    from kubernetes.client.exceptions import ApiException

    limit = max(4 * max_bytes, 65_536)
    query: list[tuple[str, Any]] = [("container", container),
                                    ("timestamps", "true"), ("limitBytes", limit)]
    if offset > 0:
        query.append(("sinceTime", time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                 time.gmtime(offset // 1_000_000_000))))
    try:
        resp = api.call_api(
            "/api/v1/namespaces/{namespace}/pods/{name}/log", "GET",
            {"namespace": namespace, "name": pod}, query, {"Accept": "*/*"},
            auth_settings=["BearerToken"], _preload_content=False,
            _request_timeout=request_timeout_s, _return_http_data_only=True)
    except ApiException as err:
        if err.status in (400, 404):  # container not started yet, or pod just replaced
            return LogChunk([], offset)
        raise api_error(f"read the log of pod {pod}", err) from err
    except network_errors() as err:
        raise BackendError(f"could not reach the Kubernetes API to read the log of pod {pod}: "
                           f"{err}") from err
    data: bytes = resp.data
    truncated = len(data) >= limit
    if truncated:
        data = data[: data.rfind(b"\n") + 1]  # the last line may be cut
    lines: list[str] = []
    used = 0
    next_offset = offset
    for raw in data.splitlines():
        stamp, _, text = raw.decode("utf-8", errors="replace").partition(" ")
        ts = log_ts_ns(stamp)
        if ts is None or ts <= offset:
            continue
        if used + len(text) + 1 > max_bytes and lines:
            break
        lines.append(text)
        used += len(text) + 1
        next_offset = ts
    if truncated and not lines:
        # More than `limit` bytes within one second before `offset`: skip to the next second
        # rather than asking for the same window forever.
        next_offset = (offset // 1_000_000_000 + 1) * 1_000_000_000 - 1
        lines = [f"[trainforge] log lines of pod {pod} skipped: more than {limit} bytes "
                 f"within one second"]
    return LogChunk(lines, next_offset)
