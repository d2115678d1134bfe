"""Typed errors raised by trainforge hooks.

Messages are built from the fields (what failed, on which object, expected vs. got, the
remedy); the original client error is chained with ``from err``. Operators catch these types,
never a client library's own exceptions.
"""

from __future__ import annotations

from collections.abc import Mapping


class HookError(Exception):
    """Base class of every error raised by a trainforge hook."""


# --- MLflow -----------------------------------------------------------------------------------


class MlflowHookError(HookError):
    """Base class of the errors raised by ``trainforge.hooks.mlflow.MlflowHook``."""


class MlflowConfigError(MlflowHookError):
    """The hook is not configured well enough to talk to MLflow (no URI, bad URI, ...)."""


class MlflowInvalidArgumentError(MlflowHookError, ValueError):
    """An argument the hook was given cannot be sent to MLflow as it is."""

    def __init__(self, argument: str, value: object, expected: str) -> None:
        self.argument = argument
        self.value = value
        self.expected = expected
        super().__init__(f"invalid {argument}: got {value!r}, expected {expected}")


class MlflowRequestError(MlflowHookError):
    """The MLflow server refused or failed a call (after the client's own retries)."""

    def __init__(self, operation: str, target: str, error_code: str | None, detail: str) -> None:
        self.operation = operation
        self.target = target
        self.error_code = error_code
        self.detail = detail
        super().__init__(
            f"MLflow {operation} failed for {target}: {error_code or 'error'}: {detail}"
        )


class MlflowParamConflictError(MlflowHookError, ValueError):
    """A param was logged on the run before with another value (MLflow params are immutable)."""

    def __init__(self, run_id: str, conflicts: Mapping[str, tuple[str, str]]) -> None:
        self.run_id = run_id
        self.conflicts = dict(conflicts)
        detail = "; ".join(
            f"{key}: logged {logged!r}, given {given!r}"
            for key, (logged, given) in sorted(self.conflicts.items())
        )
        super().__init__(
            f"params of MLflow run {run_id} cannot change: {detail}. A retry must log the same "
            "values; log a changed value under a new key or in a new run."
        )


class MlflowRegistrationError(MlflowHookError):
    """A model version ended in ``FAILED_REGISTRATION``; no alias was moved."""

    def __init__(self, name: str, version: str, status: str, status_message: str | None) -> None:
        self.name = name
        self.version = version
        self.status = status
        self.status_message = status_message
        super().__init__(
            f"model version {name} v{version} is {status}: "
            f"{status_message or 'no status message'}; no alias was moved"
        )


class MlflowTimeoutError(MlflowHookError, TimeoutError):
    """A wait on MLflow passed its deadline."""

    def __init__(self, what: str, waited_s: float, last_state: str) -> None:
        self.what = what
        self.waited_s = waited_s
        self.last_state = last_state
        super().__init__(
            f"timed out after {waited_s:.1f} s waiting for {what}; last state: {last_state}"
        )


class MlflowModelSourceError(MlflowHookError):
    """A registered model URI cannot be used: another form, or no such model version."""

    def __init__(self, uri: str, reason: str) -> None:
        self.uri = uri
        self.reason = reason
        super().__init__(f"registered model {uri}: {reason}")
