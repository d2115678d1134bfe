"""Why a Kubernetes job has not started, in Kubernetes' own words, and whether waiting can help.

In order: a suspended job waits for Kueue (the Workload's condition says why it is not
admitted); a pod's own reason (unschedulable, an image that does not pull); with no pods, a
controller's Warning event saying why it could not create them (an invalid derived object is
permanent: :func:`~trainforge.engines.kubernetes.status.creation_failure`). The listings come
from the backend (``list_events``, ``list_workloads``); a listing refused (no RBAC for events or
workloads) only loses the diagnosis, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trainforge.engines.kubernetes import names as n
from trainforge.engines.kubernetes import render as r
from trainforge.engines.kubernetes import status as s
from trainforge.errors import BackendError

log = logging.getLogger(__name__)

# Kueue's Workload API versions, newest first (v1beta2 from Kueue 0.15, v1beta1 before).
KUEUE_WORKLOAD_VERSIONS = ("v1beta2", "v1beta1")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"

ListEvents = Callable[[str, str], list[dict[str, Any]]]
"""``list_events(namespace, involved object name)``: the events of one object."""
ListWorkloads = Callable[[str, str, str], "dict[str, Any] | None"]
"""``list_workloads(version, namespace, label selector)``: Kueue workloads, None when that
API version is not served."""


def pending_reason(api: str, obj: dict[str, Any], cond: dict[str, Any] | None,
                   pods: list[dict[str, Any]], namespace: str, list_events: ListEvents,
                   list_workloads: ListWorkloads) -> tuple[str, bool]:
    """Kubernetes' own words for why the job has not started, and whether that is permanent."""
    suspended = bool((cond or {}).get("type") == "Suspended"
                     or (obj.get("spec") or {}).get("suspend")
                     or ((obj.get("spec") or {}).get("runPolicy") or {}).get("suspend"))
    if suspended:
        return kueue_reason(obj, namespace, list_workloads), False
    container = r.TRAINER_CONTAINER[api]
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        found = s.pending_reason(pod, container)
        if found:
            return found
    if not pods:
        meta = obj.get("metadata") or {}
        failure = creation_failure(api, meta.get("name"), meta.get("namespace") or namespace,
                                   list_events)
        if failure:
            return failure
        return f"no pods created yet ({s.condition_text(cond) or 'no condition yet'})", False
    return "pods are starting", False


def creation_failure(api: str, name: str, namespace: str,
                     list_events: ListEvents) -> tuple[str, bool] | None:
    """A controller's Warning event saying why it could not create the job's pods (or the
    JobSet and Job that make them), as ``(text, permanent)``; None when there is none or
    events cannot be read."""
    names = {name}
    if api == "trainjob":
        names.add(f"{name}-{n.TRAINJOB_REPLICATED_JOB}-0")  # JobSet's Job (its pods' maker)
    events: list[dict[str, Any]] = []
    for involved in sorted(names):
        try:
            events += list_events(namespace, involved)
        except BackendError as err:  # a diagnostic only (e.g. no RBAC for events)
            log.warning("Cannot read the events of %s: %s", involved, err)
            return None
    return s.creation_failure(events, names)


def kueue_reason(obj: dict[str, Any], namespace: str, list_workloads: ListWorkloads) -> str:
    """Why Kueue has not admitted the suspended job (its Workload's condition), else which
    queue it waits in."""
    meta = obj.get("metadata") or {}
    queue = (meta.get("labels") or {}).get(r.KUEUE_QUEUE_LABEL)
    uid = meta.get("uid")
    for version in KUEUE_WORKLOAD_VERSIONS:
        try:
            listing = list_workloads(version, meta.get("namespace") or namespace,
                                     f"{KUEUE_JOB_UID_LABEL}={uid}")
        except BackendError as err:  # a diagnostic only (e.g. no RBAC for workloads)
            log.warning("Cannot read Kueue's reason for %s: %s", meta.get("name"), err)
            break
        if listing is None:
            continue  # this Kueue version is not served
        for workload in listing.get("items", []):
            wmeta = workload.get("metadata") or {}
            owners = {o.get("uid") for o in wmeta.get("ownerReferences") or []}
            if uid in owners or (wmeta.get("labels") or {}).get(KUEUE_JOB_UID_LABEL) == uid:
                reason = s.workload_reason(workload)
                if reason:
                    return reason
        break
    if queue:
        return f"suspended: waiting for Kueue to admit it from LocalQueue {queue!r}"
    return "suspended (spec.suspend is true and no Kueue queue is named)"
