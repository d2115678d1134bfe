"""The Cluster page: the live training jobs of every engine, through the engines' own status
calls, each with the DAG run and task it belongs to. Read-only: only ``Backend.status``.

A deferred training task's trigger carries its job (engine, backend settings, handle: the
``TrainingJobTrigger``'s kwargs); the backend rebuilt from them answers ``status`` (local:
the job folder; Kubernetes: the TrainJob/PyTorchJob and its Kueue workload; Ray: the job
server; Slurm: squeue's state and pending reason). A task that waits in its worker slot
(``fault.deferrable: false``) or has no job yet is listed from Airflow's side only.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

from trainforge.plugins.ui.pool import POOL, bounded

STATUS_TIMEOUT_S = 5.0


def job_status(engine: str, backend_kwargs: dict[str, Any], handle: dict[str, Any]
               ) -> dict[str, Any]:
    """One ``Backend.status`` call, as plain data."""
    from trainforge.engines.descriptors import get_backend

    status = get_backend(engine, **backend_kwargs).status(handle)
    return {"state": status.state.value, "message": status.message,
            "exit_code": status.exit_code}


def live_jobs(tasks: list[dict[str, Any]], timeout_s: float = STATUS_TIMEOUT_S
              ) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The jobs of the live training tasks (trainforge.plugins.ui.metadata.live_train_tasks), and the
    engines that did not answer (``[{"engine", "error"}]``)."""
    futures: dict[cf.Future, dict[str, Any]] = {}
    jobs = []
    for task in tasks:
        kwargs = task.get("trigger_kwargs") or {}
        handle = kwargs.get("handle") or {}
        job = {"dag_id": task["dag_id"], "run_id": task["run_id"], "task_id": task["task_id"],
               "try_number": task["try_number"], "task_state": task["state"],
               "started": task["start_date"], "engine": kwargs.get("engine"),
               "job": handle.get("key"), "state": None, "message": "", "answered": None}
        jobs.append(job)
        if job["engine"] and handle:
            futures[POOL.submit(job_status, job["engine"], dict(kwargs.get("backend_kwargs") or {}),
                                dict(handle))] = job
        else:
            job["message"] = ("no job handle in Airflow: the task has not launched its job yet "
                              "or waits for it in its worker slot")
    unavailable: dict[str, str] = {}
    for future, job in bounded(futures, timeout_s):
        try:
            job.update(future.result(timeout=0), answered=True)
        except Exception as err:  # noqa: BLE001 - one engine never hides the others
            job["answered"] = False
            reason = ("no answer within %g s" % timeout_s if isinstance(err, TimeoutError)
                      else f"{type(err).__name__}: {err}")
            job["message"] = f"{job['engine']} did not answer: {reason}"
            unavailable.setdefault(job["engine"], reason)
    return jobs, [{"engine": e, "error": r} for e, r in sorted(unavailable.items())]
