"""The ``registry.approval`` block of a pipeline spec: a person approves a gate pass before the
``champion`` alias moves (docs/registry.md, "Human approval").

Who may answer is given as Airflow user ids (``approvers``): Airflow's human-in-the-loop
requests take assigned users, not roles. Whether a name is a real user depends on the auth
manager at run time (the simple auth manager's user list, an OIDC provider, ...), so the spec
checks the list's shape only: non-empty names, no surrounding spaces, no duplicates. Left out,
anyone the auth manager lets answer the DAG's required actions may answer.

``notify`` sends the request to approvers through Airflow notifiers once it is posted (mail
through an SMTP connection; the Slack and webhook notifiers need providers this project does not
install). A notifier that fails or outlasts its ``timeout`` is logged, never an answer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from trainforge.pipeline.data import StorageSection
from trainforge.pipeline.durations import DurationS
from trainforge.pipeline.pipeline import EmailNotifications
from trainforge.sections import SpecModel, check_length

#: The longest approver id: Airflow keeps a HITL request's assigned users as JSON, without a
#: limit of its own; 256 is the longest user name the auth managers shipped with Airflow take.
MAX_APPROVER_LENGTH = 256


class ApprovalEmail(SpecModel):
    """Mail the request to approvers through an Airflow SMTP connection."""

    to: list[str] = Field(min_length=1, description="Recipients of the request.")
    conn_id: str = Field("smtp_default", min_length=1,
                         description="The Airflow SMTP connection that sends the mail.")
    timeout: DurationS = Field(
        "30s", description="How long sending may take; past it the mail is given up (logged) "
        "and the request waits for its answer all the same.")

    _addresses = field_validator("to")(EmailNotifications._addresses.__func__)
    _conn_id = field_validator("conn_id")(StorageSection._conn_id.__func__)


class ApprovalNotify(SpecModel):
    """Where the request is sent when it is posted (each notifier on its own timeout)."""

    email: ApprovalEmail | None = Field(None, description="Mail the request (SMTP).")


class ApprovalSection(SpecModel):
    """A person approves each gate pass before ``champion`` moves."""

    approvers: list[str] | None = Field(
        None,
        description="Airflow user ids that may answer (the simple auth manager's user names, "
        "an identity provider's user ids); leave out to let every user the auth manager allows "
        "to answer this DAG's required actions answer.",
    )
    timeout: DurationS = Field(
        "7d", description="How long the request waits for an answer, from when it is asked.",
    )
    on_timeout: Literal["reject", "fail"] = Field(
        "reject",
        description="No answer in time. reject: the version is tagged rejected and champion "
        "stays (the task succeeds); fail: the approval task fails (failure notifications go "
        "out) and champion stays. A timeout never promotes.",
    )
    notify: ApprovalNotify | None = Field(
        None, description="Send the request to approvers when it is posted. A notifier that "
        "fails or times out is logged; it never answers the request or fails the task, and the "
        "timeout above counts from the posting, not from when the notifiers finish.",
    )

    @field_validator("approvers")
    @classmethod
    def _approvers(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("an empty list lets nobody answer (got []; expected at least one "
                             "Airflow user id, or leave approvers out so that every user allowed "
                             "to answer this DAG's required actions can)")
        seen: set[str] = set()
        for name in value:
            check_length(name, MAX_APPROVER_LENGTH, "an approver's user id")
            if name != name.strip():
                raise ValueError(f"an approver's user id has spaces around it (got {name!r}; "
                                 f"expected {name.strip()!r})")
            if name in seen:
                raise ValueError(f"approver {name!r} is listed twice (got {value!r}; expected "
                                 f"each user id once)")
            seen.add(name)
        return value
