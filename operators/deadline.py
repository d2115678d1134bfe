"""``pipeline.deadline``: an Airflow deadline alert that mails the pipeline's notification
recipients when a DAG run is still running that long after it was queued.

Airflow's scheduler checks the deadline (``DeadlineReference.DAGRUN_QUEUED_AT`` plus the
spec's duration) and, once missed, the triggerer runs the callback: Airflow's
``SmtpNotifier`` with ``pipeline.notifications.email.to`` (the spec model requires the email
block with a deadline). The alert only notifies: the run goes on, and its tasks keep their own
timeouts. A run that ends before the deadline never notifies.

The callback's context is the deadline's, not a task's: ``dag_run`` (the REST API's DAG run
fields) and ``deadline`` (``id``, ``deadline_time``), so the templates below use only those.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import AsyncCallback, DeadlineAlert, DeadlineReference

from trainforge.pipeline.durations import format_duration

SUBJECT = "trainforge {dag_id}: run {{{{ dag_run.dag_run_id }}}} overdue ({after})"
BODY = ("<p>DAG run <code>{{{{ dag_run.dag_run_id }}}}</code> of pipeline <code>{dag_id}</code> "
        "is still running {after} after it was queued (deadline "
        "{{{{ deadline.deadline_time }}}}). It goes on running; look at its tasks in Airflow."
        "</p>")


def deadline_alert(spec) -> DeadlineAlert | None:
    """The DAG's deadline alert for ``spec.pipeline.deadline``; None when it has none."""
    seconds = spec.pipeline.deadline
    if seconds is None:
        return None
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    email = spec.pipeline.notifications.email  # required by the spec model with a deadline
    after = format_duration(seconds)
    return DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=dt.timedelta(seconds=seconds),
        callback=AsyncCallback(SmtpNotifier, kwargs={
            "to": list(email.to),
            "subject": SUBJECT.format(dag_id=spec.dag_id, after=after),
            "html_content": BODY.format(dag_id=spec.dag_id, after=after),
        }),
        name=f"{spec.dag_id}-overdue",
    )
