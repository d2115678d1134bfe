"""Consumer DAGs of a model's champion asset that act on the newest champion and strand no event.

Airflow 3.3 keeps one queue row per (asset, consumer DAG) in ``asset_dag_run_queue``; its time is
that of the first event queued since the last run, and a later event finds the row there and
leaves it as it is. The scheduler gives a new run the events up to that time and deletes the
row, so an event that came after the row but before the run is consumed by no run until some
other event comes (Airflow #56050). ``max_active_runs=1`` widens that window to a whole run; a
burst faster than one scheduler loop is enough without it.

`handoff_dag` builds a consumer that is safe under those rules:

- ``act_on_champion`` re-reads ``champion`` from MLflow (the event's version may be old by then)
  and acts on that version unless this DAG acted on it last (a registered-model tag
  ``trainforge.handoff.<dag_id>``): idempotent, so a run that consumed several events acts once;
- ``requeue_stranded`` (after it, whatever its outcome) looks for champion events newer than the
  events this run was given: any such event is queued for a later run or stranded, and it emits
  one event of the DAG's own requeue asset, on which the DAG is scheduled too, so a next run
  comes and the scheduler gives it every champion event up to then.

A stranded event was emitted before the run that stranded it was created, so that run's
``act_on_champion`` already sees its version and its ``requeue_stranded`` sees the event.
Nothing here imports MLflow or Airflow at module level (DAG files import it while parsing).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from trainforge.tasks.register_model import model_asset, model_asset_name

log = logging.getLogger("trainforge.handoff")

CHAMPION = "champion"
ACTED_TAG_PREFIX = "trainforge.handoff."
"""Registered-model tag ``trainforge.handoff.<dag_id>``: the version that DAG acted on last."""

Act = Callable[[str, str], Any]
"""What a consumer does with the champion: ``act(model_name, version)``; its return is logged
and returned by the task (keep it JSON-serialisable)."""


def acted_tag(dag_id: str) -> str:
    """The registered-model tag holding the version ``dag_id`` acted on last."""
    return f"{ACTED_TAG_PREFIX}{dag_id}"


def requeue_asset_name(dag_id: str) -> str:
    """The consumer's own asset: an event of it queues one more run of ``dag_id``."""
    return f"trainforge-handoff-requeue-{dag_id}"


def act_on_champion(model_name: str, dag_id: str, act: Act, client: Any = None) -> dict[str, Any]:
    """Act on the version ``champion`` points at now, once per move.

    Returns ``{"version", "acted", "result"}``: ``acted`` False (and ``result`` None) when this
    DAG's last act was on that version already. The tag is set after ``act`` returns, so an act
    that fails is retried by the next run.

    Raises:
        mlflow.exceptions.MlflowException: the model has no champion or MLflow cannot be reached.
    """
    if client is None:
        import mlflow

        client = mlflow.MlflowClient()
    version = str(client.get_model_version_by_alias(model_name, CHAMPION).version)
    tag = acted_tag(dag_id)
    last = client.get_registered_model(model_name).tags.get(tag)
    if last == version:
        log.info("%s@%s is v%s, which %s acted on last: nothing to do", model_name, CHAMPION,
                 version, dag_id)
        return {"version": version, "acted": False, "result": None}
    result = act(model_name, version)
    client.set_registered_model_tag(model_name, tag, version)
    log.info("%s acted on %s v%s (last: %s): %r", dag_id, model_name, version, last, result)
    return {"version": version, "acted": True, "result": result}


def events_after(events: Iterable[Any], run_after: dt.datetime) -> list[Any]:
    """The events (anything with a ``timestamp``) newer than ``run_after``: a run of an
    asset-triggered DAG is given the events up to its ``run_after`` only."""
    return [e for e in events if e.timestamp > run_after]


def handoff_dag(dag_id: str, model_name: str, act: Act, *, description: str | None = None,
                tags: Sequence[str] = ("trainforge", "handoff"), max_active_runs: int = 1,
                start_date: dt.datetime = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)):
    """A DAG scheduled on ``model_asset(model_name)`` (and its requeue asset) that acts on the
    newest champion with ``act`` and strands no event (module doc).

    ``max_active_runs`` 1 (the default) runs one act at a time; events that come meanwhile are
    consumed by the next run, which acts once, on the newest champion.
    """
    from airflow.sdk import DAG, Asset, task
    from airflow.sdk.exceptions import AirflowSkipException

    champion = model_asset(model_name)
    requeue = Asset(name=requeue_asset_name(dag_id))
    with DAG(
        dag_id=dag_id,
        description=description or f"Act on {model_name}@{CHAMPION} whenever it moves",
        schedule=champion | requeue,
        start_date=start_date,
        catchup=False,
        max_active_runs=max_active_runs,
        tags=list(tags),
    ) as dag:

        @task(task_id="act_on_champion")
        def act_task(**context: Any) -> dict[str, Any]:
            events = (context.get("triggering_asset_events") or {}).get(champion) or []
            log.info("run given %d event(s) of %s, versions %s", len(events),
                     model_asset_name(model_name),
                     [(e.extra or {}).get("version") for e in events])
            return act_on_champion(model_name, dag_id, act)

        @task(task_id="requeue_stranded", trigger_rule="all_done", inlets=[champion],
              outlets=[requeue])
        def requeue_task(**context: Any) -> list[int]:
            run_after = context["dag_run"].run_after
            newer = events_after(context["inlet_events"][champion].after(run_after), run_after)
            if not newer:
                raise AirflowSkipException(f"no event of {champion.name} after {run_after}")
            log.info("%d event(s) of %s came after this run's (ids %s): queueing one more run "
                     "through %s", len(newer), champion.name, [e.id for e in newer],
                     requeue.name)
            return [e.id for e in newer]

        act_task() >> requeue_task()
    return dag
