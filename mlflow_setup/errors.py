"""Typed errors of ``mlflow_setup``.

Each message is built from the fields: what failed, on which server or home, what was
expected, what was seen last, and what to do about it.
"""

from __future__ import annotations


class MlflowSetupError(Exception):
    """Base class of every error raised by ``mlflow_setup``."""


class ServerStartError(MlflowSetupError):
    """The MLflow server could not be started (bad arguments, port in use, early exit)."""

    def __init__(self, home: str, reason: str, log_tail: str = "") -> None:
        self.home = home
        self.reason = reason
        self.log_tail = log_tail
        message = f"could not start the MLflow server for home {home}: {reason}"
        if log_tail:
            message += f"\n--- last lines of the server log ---\n{log_tail}"
        super().__init__(message)


class HealthTimeoutError(MlflowSetupError, TimeoutError):
    """``GET <url>/health`` did not answer ``200 OK`` before the deadline."""

    def __init__(self, url: str, timeout_s: float, last_state: str, log_tail: str = "") -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.last_state = last_state
        self.log_tail = log_tail
        message = (
            f"MLflow server at {url} was not healthy after waiting {timeout_s:.1f} s for "
            f"GET {url}/health to answer 200 OK; last state seen: {last_state}. "
            "Check that the server is running (python -m trainforge.mlflow_setup start) and that the "
            "URL, host and port are right."
        )
        if log_tail:
            message += f"\n--- last lines of the server log ---\n{log_tail}"
        super().__init__(message)


class ServerStopError(MlflowSetupError):
    """The server's process group did not exit even after SIGKILL."""

    def __init__(self, pid: int, waited_s: float) -> None:
        self.pid = pid
        self.waited_s = waited_s
        super().__init__(
            f"MLflow server process group {pid} was still alive {waited_s:.1f} s after SIGTERM "
            f"and SIGKILL; inspect it with `ps -g {pid}`"
        )


class StoreArgumentError(MlflowSetupError, ValueError):
    """A backend store URI or artifact destination of an unsupported scheme or shape."""

    def __init__(self, option: str, value: str, expected: str) -> None:
        self.option = option
        self.value = value  # passwords already replaced by ***
        self.expected = expected
        super().__init__(f"{option} {value!r}: expected {expected}")


class StoreUnreachableError(MlflowSetupError):
    """The backend store database or the artifact bucket did not answer or refused access."""

    def __init__(self, uri: str, reason: str) -> None:
        self.uri = uri  # passwords already replaced by ***
        self.reason = reason
        super().__init__(f"cannot reach {uri}: {reason}; check the host, port, database or "
                         "bucket name and the credentials")
