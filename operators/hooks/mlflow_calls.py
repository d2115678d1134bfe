"""How every MLflow call of the hooks is made: MLflow's exceptions become
:class:`~trainforge.hooks.errors.MlflowRequestError` naming the call and its target, values in
search filters are quoted, and a fluent ``mlflow.<flavor>`` call gets a scoped tracking URI.

``mlflow`` is imported inside the functions only: importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from trainforge.hooks.errors import MlflowInvalidArgumentError, MlflowRequestError

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
