"""How every MLflow call of the hooks is made: MLflow's exceptions become
:class:`~trainforge.hooks.errors.MlflowRequestError` naming the call and its target, values in
search filters are quoted, a fluent ``mlflow.<flavor>`` call gets a scoped tracking URI, and an
Airflow connection names the tracking server.

``mlflow`` is imported inside the functions only: importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from trainforge.hooks.errors import (
    MlflowConfigError,
    MlflowInvalidArgumentError,
    MlflowRequestError,
)

# mlflow.<flavor>.log_model resolves the *global* tracking URI; see fluent_tracking_uri.
_FLUENT_LOCK = threading.Lock()


def quote(argument: str, value: str) -> str:
    """Quote ``value`` for an MLflow search filter (MLflow has no escape inside quotes)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise MlflowInvalidArgumentError(argument, value, "a string without both ' and \" quotes")


@contextlib.contextmanager
def mlflow_errors(operation: str, target: str) -> Iterator[None]:
    """Turn MLflow's exceptions into MlflowRequestError naming the operation and its target."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as err:
        raise MlflowRequestError(operation, target, err.error_code, err.message) from err


@contextlib.contextmanager
def fluent_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's global tracking URI at ``uri`` for one fluent call, then restore it.

    ``Model.log`` (behind ``mlflow.transformers.log_model``) builds its client from the
    global tracking URI and ``mlflow.set_tracking_uri`` also writes ``MLFLOW_TRACKING_URI``
    into ``os.environ``. Both are restored exactly afterwards; the URI never holds credentials
    (refused in ``MlflowHook.tracking_uri``). A lock keeps threads of this process from
    interleaving.
    """
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_utils

    with _FLUENT_LOCK:
        saved_uri = getattr(tracking_utils, "_tracking_uri", None)
        saved_env = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(saved_uri)  # type: ignore[arg-type]
            if saved_env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = saved_env


def tracking_uri_from_connection(conn_id: str) -> str:
    """``scheme://host:port[/schema]`` of Airflow connection ``conn_id``.

    Raises:
        MlflowConfigError: the connection cannot be read, has no host, or carries a login or
        password (MLflow would need them in ``os.environ``, which trainforge never writes).
    """
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as err:  # noqa: BLE001 - Airflow raises several types for "not found"
        raise MlflowConfigError(
            f"Airflow connection {conn_id!r} for MLflow could not be read: {err}"
        ) from err
    if conn.login or conn.password:
        raise MlflowConfigError(
            f"Airflow connection {conn_id!r} carries a login or password; MLflow would need "
            "them in os.environ, which trainforge never writes: use an unauthenticated "
            "endpoint or a proxy"
        )
    if not conn.host:
        raise MlflowConfigError(f"Airflow connection {conn_id!r} has no host")
    scheme = conn.conn_type if conn.conn_type in ("http", "https") else "http"
    port = f":{conn.port}" if conn.port else ""
    return f"{scheme}://{conn.host}{port}{('/' + conn.schema) if conn.schema else ''}"
