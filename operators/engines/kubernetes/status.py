"""Pure reading of Kubernetes status: job conditions, pods and Kueue workloads → neutral states.

Everything here works on the plain JSON the API returns (dicts), so it is tested without a
server. The backend (:mod:`trainforge.engines.kubernetes.backend`) fetches; this module decides.

The job's outcome comes from the custom resource's ``status.conditions`` only — never from
whether a pod still exists. Pods are read for what conditions do not say: whether rank 0 has
started, why it is still pending, its exit code and result, and how often it was restarted.
"""

from __future__ import annotations

import calendar
import json
import time
from typing import Any

from trainforge.engines.base import JobState
from trainforge.engines.kubernetes.names import TRAINJOB_REPLICATED_JOB

# Condition type (status "True") → state, checked in this order; the first that holds wins.
#
# TrainJob (trainer.kubeflow.org/v1alpha1, Kubeflow Trainer 2.3; condition types from
# pkg/apis/trainer/v1alpha1/trainjob_types.go):
#   Failed     the JobSet failed, the runtime is unsupported, or activeDeadlineSeconds passed
#   Complete   every training node finished
#   Suspended  spec.suspend is true: waiting for Kueue to admit the whole gang
#   (none)     created: RUNNING once rank 0's pod runs, PENDING before (TrainJob has no
#              Running condition)
TRAINJOB_CONDITIONS: list[tuple[str, JobState]] = [
    ("Failed", JobState.FAILED),
    ("Complete", JobState.SUCCEEDED),
    ("Suspended", JobState.PENDING),
]
# PyTorchJob (kubeflow.org/v1, training operator 1.9; JobConditionType in
# pkg/apis/kubeflow.org/v1/common_types.go):
#   Failed      a replica failed beyond runPolicy.backoffLimit, or activeDeadlineSeconds passed
#   Succeeded   the Master replica finished
#   Suspended   runPolicy.suspend is true: waiting for Kueue
#   Restarting  a pod is being restarted (restartPolicy OnFailure); counted against max_restarts
#   Running     every replica's pods are running
#   Created     accepted by the operator, pods not yet running
TORCHJOB_CONDITIONS: list[tuple[str, JobState]] = [
    ("Failed", JobState.FAILED),
    ("Succeeded", JobState.SUCCEEDED),
    ("Suspended", JobState.PENDING),
    ("Restarting", JobState.RUNNING),
    ("Running", JobState.RUNNING),
    ("Created", JobState.PENDING),
]
CONDITIONS = {"trainjob": TRAINJOB_CONDITIONS, "pytorchjob": TORCHJOB_CONDITIONS}

# Waiting reasons of a container that will not start by itself.
IMAGE_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_REASONS = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


def true_conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The object's conditions whose status is ``"True"``, by type."""
    conds = (obj.get("status") or {}).get("conditions") or []
    return {c.get("type"): c for c in conds if str(c.get("status")) == "True"}


def job_state(api: str, obj: dict[str, Any]) -> tuple[JobState | None, dict[str, Any] | None]:
    """``(state, condition)`` from the mapping table of ``api``; ``(None, None)`` when no
    condition holds yet (a TrainJob without conditions is decided from its pods)."""
    held = true_conditions(obj)
    for ctype, state in CONDITIONS[api]:
        if ctype in held:
            return state, held[ctype]
    return None, None


def condition_text(cond: dict[str, Any] | None) -> str:
    """``"Type (Reason): message"`` of a condition, for humans."""
    if not cond:
        return ""
    reason = f" ({cond['reason']})" if cond.get("reason") else ""
    message = f": {cond['message']}" if cond.get("message") else ""
    return f"{cond.get('type')}{reason}{message}"


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == name:
            return status
    return {}


def pod_restarts(pod: dict[str, Any]) -> int:
    """How often this pod's work was restarted: JobSet's restart attempt (a label on the pods it
    recreates) plus the in-place container restarts of every container."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        attempt = int(labels.get("jobset.sigs.k8s.io/restart-attempt", 0))
    except ValueError:
        attempt = 0
    in_place = max([int(s.get("restartCount") or 0)
                    for s in (pod.get("status") or {}).get("containerStatuses") or []] or [0])
    return attempt + in_place


def pod_started(pod: dict[str, Any]) -> bool:
    """Rank 0's pod runs or has run (phase Running, Succeeded or Failed)."""
    return (pod.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed")


def pending_reason(pod: dict[str, Any], container: str) -> tuple[str, bool] | None:
    """Kubernetes' own reason why ``pod`` has not started: ``(text, permanent)``, or None.

    Looks at the pod's ``PodScheduled`` condition (``Unschedulable``: no node fits) and at the
    container's waiting state (image pull and configuration errors such as a missing Secret).
    """
    name = (pod.get("metadata") or {}).get("name", "?")
    status = pod.get("status") or {}
    waiting = (_container(pod, container).get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason")
    if reason in IMAGE_REASONS or reason in CONFIG_REASONS:
        text = f"pod {name} {reason}: {waiting.get('message') or 'no message'}"
        return text, reason in ("InvalidImageName", "ErrImageNeverPull")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and str(cond.get("status")) == "False":
            return (f"pod {name} {cond.get('reason') or 'not scheduled'}: "
                    f"{cond.get('message') or 'no message'}"), False
    return None


# Warning events by which a controller says it could not create the job's pods or the objects
# that make them: Kubeflow Trainer on the TrainJob (its JobSet), JobSet on the JobSet (its Jobs),
# the Job controller on a Job (its pods), the training operator on the PyTorchJob (pods,
# services).
CREATION_FAILED_REASONS = {"TrainJobResourcesCreationFailed", "JobCreationFailed", "FailedCreate",
                           "FailedCreatePod", "FailedCreateService"}
# The API's words for a request it refuses as invalid: asking again gets the same answer.
# (Others, such as an exceeded ResourceQuota, may clear up by themselves.)
REFUSAL_MARKERS = ("is invalid", "Invalid value", "denied the request", "must be no more than")
# Reason of a TrainJob's Failed condition when its objects could not be created (Trainer 2.3+).
RESOURCES_CREATION_FAILED = "ResourcesCreationFailed"


def is_refusal(message: str) -> bool:
    """Whether an API error message refuses a request as invalid (not worth retrying)."""
    return any(marker in message for marker in REFUSAL_MARKERS)


def creation_failure(events: list[dict[str, Any]], names: set[str]) -> tuple[str, bool] | None:
    """The newest Warning event of the objects ``names`` that says a controller could not create
    the job's pods (or the objects that make them): ``(text, permanent)``, or None.

    Permanent when the API refused the object as invalid (:data:`REFUSAL_MARKERS`).
    """
    found = [e for e in events
             if e.get("type") == "Warning" and e.get("reason") in CREATION_FAILED_REASONS
             and ((e.get("involvedObject") or {}).get("name") in names)]
    if not found:
        return None
    newest = max(found, key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "",
                                       int(e.get("count") or 1)))
    obj = newest.get("involvedObject") or {}
    message = newest.get("message") or newest.get("note") or "no message"
    text = f"{obj.get('kind', 'object')} {obj.get('name')} {newest.get('reason')}: {message}"
    return text, is_refusal(message)


def workload_reason(workload: dict[str, Any]) -> str | None:
    """Why Kueue has not admitted a workload (``QuotaReserved`` or ``Admitted`` false), or None."""
    conds = {c.get("type"): c for c in (workload.get("status") or {}).get("conditions") or []}
    for ctype in ("QuotaReserved", "Admitted"):
        cond = conds.get(ctype)
        if cond and str(cond.get("status")) == "False":
            name = (workload.get("metadata") or {}).get("name", "?")
            return (f"Kueue workload {name} {ctype}=False ({cond.get('reason') or 'no reason'}): "
                    f"{cond.get('message') or 'no message'}")
    if not conds.get("QuotaReserved"):
        name = (workload.get("metadata") or {}).get("name", "?")
        return f"Kueue workload {name} is waiting in its queue for quota"
    return None


def rank0_termination(pod: dict[str, Any] | None, container: str) -> tuple[int | None, dict[str, Any] | None]:
    """``(exit code, result)`` of rank 0's trainer container: the terminated state (or the last
    one, after an in-place restart) and the result JSON from its termination message."""
    if not pod:
        return None, None
    status = _container(pod, container)
    term = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get("terminated")
    if not term:
        return None, None
    result = None
    message = term.get("message")
    if message:
        try:
            parsed = json.loads(message)
            result = parsed if isinstance(parsed, dict) else None
        except json.JSONDecodeError:
            result = None
    code = term.get("exitCode")
    return (int(code) if code is not None else None), result


def epoch_s(timestamp: str | None) -> float | None:
    """RFC 3339 ``2026-01-02T03:04:05Z`` (optionally with a fraction) → UNIX seconds."""
    if not timestamp:
        return None
    base, _, frac = timestamp.rstrip("Z").partition(".")
    try:
        whole = calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
    return whole + (float(f"0.{frac}") if frac.isdigit() else 0.0)


# Labels of rank 0's pod: JobSet (TrainJob) and the training operator (PyTorchJob).
RANK0_LABELS = {
    "trainjob": {"jobset.sigs.k8s.io/replicatedjob-name": TRAINJOB_REPLICATED_JOB,
                 "batch.kubernetes.io/job-completion-index": "0"},
    "pytorchjob": {"training.kubeflow.org/replica-type": "master",
                   "training.kubeflow.org/replica-index": "0"},
}


def labels_match(labels: dict[str, str] | None, selector: dict[str, str]) -> bool:
    """Whether ``labels`` carry every key and value of ``selector``."""
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


def rank0_pod(api: str, pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Rank 0's pod among the job's ``pods`` (the newest of them), or None."""
    candidates = [p for p in pods
                  if labels_match((p.get("metadata") or {}).get("labels"), RANK0_LABELS[api])]
    if not candidates:
        return None
    # The newest pod speaks for the current attempt (JobSet recreates pods on restart).
    return max(candidates, key=lambda p: ((p.get("metadata") or {}).get("creationTimestamp") or "",
                                          pod_restarts(p)))


def wall_s(handle: dict[str, Any], cond: dict[str, Any] | None,
           rank0: dict[str, Any] | None) -> float | None:
    """Seconds from rank 0's pod start (else the job's creation) to the final condition."""
    ended = epoch_s((cond or {}).get("lastTransitionTime"))
    started = epoch_s(((rank0 or {}).get("status") or {}).get("startTime")) or handle.get(
        "submitted_at_epoch_s")
    if ended is None or started is None:
        return None
    return round(max(0.0, ended - started), 3)


def phases(handle: dict[str, Any], rank0: dict[str, Any] | None,
           container: str) -> dict[str, float | str]:
    """The ledger's engine buckets of a finished job, from rank 0's newest pod: ``queue_wait``
    from the job's creation to the pod's start (Kueue admission, scheduling), ``image_pull``
    from the pod's start to the trainer container's first start (image pull, init containers)."""
    status = (rank0 or {}).get("status") or {}
    pod_start = epoch_s(status.get("startTime"))
    submitted = handle.get("submitted_at_epoch_s")
    state = _container(rank0, container) if rank0 else {}
    started = (((state.get("state") or {}).get("terminated") or {}).get("startedAt")
               or ((state.get("lastState") or {}).get("terminated") or {}).get("startedAt"))
    container_start = epoch_s(started)
    why = "unknown: rank 0's pod is gone (deleted or replaced) and with it its start times"
    return {"queue_wait": round(max(0.0, pod_start - submitted), 3)
            if pod_start is not None and submitted else why,
            "image_pull": round(max(0.0, container_start - pod_start), 3)
            if pod_start is not None and container_start is not None else why}
