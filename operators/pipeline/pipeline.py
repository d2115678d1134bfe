"""The ``pipeline`` section of a spec: the DAG's identity, schedule, task defaults, notifications.

Schedules: a cron expression (5 fields, checked with croniter), an Airflow preset, ``null`` for
manual runs only, or ``{assets: [...]}`` to run when upstream assets (e.g. a new dataset) are
updated. An unknown form is an error, never a silent default.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainforge.sections import SpecModel, check_length, field_errors
from trainforge.pipeline.durations import DelayS, DurationS

_DAG_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")
#: The longest pipeline name: Airflow's dag_id may have 250 characters; run ids and the
#: identities derived from the name need the rest.
MAX_NAME_LENGTH = 200
_PRESETS = ("@once", "@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly")
_ASSET_URI = re.compile(r"^[a-z][a-z0-9+.\-]*://\S+$")
TASK_IDS = ("prepare_data", "train", "validate_checkpoint", "register_model", "approve_champion")


class AssetSchedule(SpecModel):
    """Run when upstream Airflow assets are updated."""

    assets: list[str] = Field(
        min_length=1, description="Asset URIs (e.g. s3://bucket/corpus/, file:///data/corpus)."
    )
    mode: Literal["any", "all"] = Field(
        "any", description="Run when any one asset is updated, or only once all of them are."
    )

    @field_validator("assets")
    @classmethod
    def _uris(cls, value: list[str]) -> list[str]:
        for uri in value:
            if not _ASSET_URI.match(uri):
                raise ValueError(
                    f"not an asset URI (got {uri!r}; expected scheme://path such as "
                    f"'s3://bucket/corpus/' or 'file:///data/corpus')"
                )
        return value


class TaskSettings(SpecModel):
    """Airflow settings of one task; unset fields take the pipeline defaults."""

    retries: int | None = Field(None, ge=0, le=20, description="Retries after a failure.")
    retry_delay: DelayS | None = Field(None, description="Delay between retries; 0s retries "
                                       "at once.")
    execution_timeout: DurationS | None = Field(
        None, description="Longest one try may run, counted from its first start."
    )


class TaskDefaults(SpecModel):
    """Airflow settings of every task unless a task overrides them."""

    retries: int = Field(0, ge=0, le=20, description="Retries after a failure.")
    retry_delay: DelayS = Field("5m", description="Delay between retries; 0s retries at once.")
    execution_timeout: DurationS | None = Field(
        None, description="Longest one try may run (train: run_timeout plus 10 minutes)."
    )


class TaskOverrides(SpecModel):
    """Per-task settings, by task id."""

    prepare_data: TaskSettings = TaskSettings()
    train: TaskSettings = TaskSettings()
    validate_checkpoint: TaskSettings = TaskSettings()
    register_model: TaskSettings = TaskSettings()
    approve_champion: TaskSettings = Field(
        TaskSettings(), description="The approval task (registry.approval); its "
        "execution_timeout does not count the wait for an answer (registry.approval.timeout).")


class EmailNotifications(SpecModel):
    to: list[str] = Field(min_length=1, description="Recipients.")
    on: list[Literal["failure", "retry", "success"]] = Field(
        default_factory=lambda: ["failure"], description="Which task outcomes send a mail."
    )

    @field_validator("to")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for address in value:
            if not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", address):
                raise ValueError(f"not an email address (got {address!r})")
        return value


class NotificationsSection(SpecModel):
    email: EmailNotifications | None = Field(
        None, description="Mail through Airflow's SMTP connection (smtp_default)."
    )


class PipelineSection(SpecModel):
    """The DAG: its id, documentation, schedule and task settings."""

    name: str = Field(description="Pipeline name; becomes the Airflow dag_id.")
    description: str = Field("", description="Shown as the DAG's documentation in the Airflow UI.")
    owner: str = Field("trainforge", description="Airflow task owner.")
    tags: list[str] = Field(default_factory=list, description="Airflow DAG tags.")
    schedule: str | AssetSchedule | None = Field(
        None,
        description="Cron expression (5 fields), an Airflow preset (@daily, @weekly, ...), "
        "{assets: [...]} to run when upstream assets update, or null for manual runs only.",
    )
    start_date: dt.date = Field(dt.date(2026, 1, 1), description="First logical date (UTC).")
    catchup: bool = Field(False, description="Create runs for past intervals since start_date.")
    max_active_runs: int = Field(1, ge=1, le=64, description="Concurrent DAG runs.")
    defaults: TaskDefaults = Field(TaskDefaults(), description="Settings of every task.")
    tasks: TaskOverrides = Field(TaskOverrides(), description="Per-task overrides of defaults.")
    notifications: NotificationsSection = NotificationsSection()
    mlflow_experiment: str | None = Field(
        None, description="MLflow experiment for this pipeline's runs; defaults to the name."
    )
    deadline: DurationS | None = Field(
        None, description="A DAG run still running this long after it was queued is overdue: "
        "an Airflow deadline alert mails pipeline.notifications.email (required with it). The "
        "run itself goes on.",
    )

    @model_validator(mode="after")
    def _deadline_notifies(self) -> PipelineSection:
        if self.deadline is not None and self.notifications.email is None:
            raise field_errors(PipelineSection, (
                ("deadline",), "pipeline.deadline notifies through pipeline.notifications, but "
                "none is set (got no notifications.email; expected notifications.email with "
                "'to' recipients, or no deadline)", self.deadline, ()))
        return self

    @field_validator("name")
    @classmethod
    def _name_is_dag_id(cls, value: str) -> str:
        check_length(value, MAX_NAME_LENGTH, "a dag_id")
        if not _DAG_ID.match(value):
            raise ValueError(
                f"not a valid dag_id (got {value!r}; expected letters, digits, '_', '.', '-')"
            )
        return value

    @field_validator("schedule")
    @classmethod
    def _schedule_known(cls, value):
        if value is None or isinstance(value, AssetSchedule):
            return value
        if value.startswith("@"):
            if value not in _PRESETS:
                raise ValueError(
                    f"unknown schedule preset (got {value!r}; expected one of "
                    f"{', '.join(_PRESETS)}, a cron expression or null)"
                )
            return value
        from croniter import croniter

        if len(value.split()) != 5 or not croniter.is_valid(value):
            raise ValueError(
                f"not a valid cron expression (got {value!r}; expected 5 fields like "
                f"'0 3 * * 1', a preset such as '@weekly', or null)"
            )
        return value
