"""How trainforge reaches a Ray job API: the Airflow connection, and a client with timeouts.

``ray`` is imported only inside :func:`timeout_client_class`, never at import time.
"""

from __future__ import annotations

from typing import Any

from trainforge.errors import BackendError

_CLIENT_CLASS = None


def timeout_client_class() -> type:
    """``JobSubmissionClient`` whose every HTTP call has a timeout (the SDK sets none)."""
    global _CLIENT_CLASS
    if _CLIENT_CLASS is None:
        from ray.job_submission import JobSubmissionClient

        class TimeoutJobSubmissionClient(JobSubmissionClient):
            def __init__(self, *args: Any, timeout_s: float = 30.0, **kwargs: Any):
                self._timeout_s = timeout_s
                super().__init__(*args, **kwargs)

            def _do_request(self, method: str, endpoint: str, **kwargs: Any):
                # (connect, read) timeouts of requests; uploads of a working_dir get longer.
                kwargs.setdefault("timeout", (10.0, max(self._timeout_s, 600.0)
                                              if method == "PUT" else self._timeout_s))
                return super()._do_request(method, endpoint, **kwargs)

        _CLIENT_CLASS = TimeoutJobSubmissionClient
    return _CLIENT_CLASS


def connection_settings(conn_id: str) -> tuple[str, dict[str, str], bool | str]:
    """``(address, headers, verify)`` of the Ray job API from an Airflow connection.

    Host and port give the dashboard address (``http://<host>:<port or 8265>``, ``https`` when
    the connection type is https; a host with a scheme is used as it is); the password, if any,
    becomes a Ray token header (``Authorization: Bearer``, for ``RAY_AUTH_MODE=token``); extras
    ``headers`` (dict) and ``verify`` (bool or CA bundle path) go to the client.

    Raises:
        BackendError: the connection cannot be read or has no host.
    """
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as err:  # noqa: BLE001 - Airflow raises several types for "not found"
        raise BackendError(f"Airflow connection {conn_id!r} for Ray could not be read: {err}") \
            from err
    if not conn.host:
        raise BackendError(f"Airflow connection {conn_id!r} for Ray has no host (expected the "
                           f"dashboard's host, e.g. 'raycluster-head-svc')")
    if "://" in conn.host:
        address = conn.host.rstrip("/")
    else:
        scheme = conn.conn_type if conn.conn_type in ("http", "https") else "http"
        address = f"{scheme}://{conn.host}:{conn.port or 8265}"
    extra = conn.extra_dejson or {}
    headers = {str(k): str(v) for k, v in (extra.get("headers") or {}).items()}
    if conn.password:
        headers["Authorization"] = f"Bearer {conn.password}"
    verify = extra.get("verify", True)
    return address, headers, verify
