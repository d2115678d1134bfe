"""Typed errors of the orchestration side. Messages say what failed, on what, and the remedy."""

from __future__ import annotations


class TrainforgeError(Exception):
    """Base of every error raised by the operators package."""


class BackendError(TrainforgeError):
    """An engine could not be reached or refused a request."""


class JobNotFoundError(BackendError):
    """A job handle names a job the engine does not know."""


class TriggerEventError(TrainforgeError):
    """A trigger event does not have the expected shape."""


class StageError(TrainforgeError):
    """A pipeline stage (data prep, validation, registration) failed on its inputs."""
