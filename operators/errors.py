"""Typed errors of the orchestration side. Messages say what failed, on what, and the remedy."""

from __future__ import annotations


class TrainforgeError(Exception):
    """Base of every error raised by the operators package."""


class BackendError(TrainforgeError):
    """An engine could not be reached or refused a request."""


class JobRefusedError(BackendError):
    """The engine refused the job for good (Kubernetes: HTTP 422, an admission webhook's denial,
    a field the installed CRD lacks, or RBAC denying a verb): sending the same request again is
    refused again, so the task fails without retries.
    """


class JobNotFoundError(BackendError):
    """A job handle names a job the engine does not know."""


class TriggerEventError(TrainforgeError):
    """A trigger event does not have the expected shape."""


class PluginNotLoaded(TrainforgeError):
    """Airflow did not load the trainforge plugin in this process (trainforge.plugin_status):
    raised while a DAG file is parsed, so the plugin's reason is that file's import error."""


class EnvironmentConflict(TrainforgeError):
    """An installed package is outside what trainforge needs (trainforge.doctor): raised while a
    DAG file is parsed, so the conflict is that file's import error."""
