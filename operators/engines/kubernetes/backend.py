"""The ``kubernetes`` engine: a Kubeflow ``TrainJob`` or ``PyTorchJob``, optionally queued by Kueue.

What is submitted is :func:`trainforge.engines.kubernetes.render.render_objects` — a ConfigMap with the
job config and the custom resource — created with the official ``kubernetes`` client
(``CoreV1Api``, ``CustomObjectsApi``). Status comes from the resource's conditions through the
commented tables in :mod:`trainforge.engines.kubernetes.status`; pods are read only for what conditions
do not say (rank 0 started, why it is pending, its exit code, restarts).

Handle (JSON)::

    {"engine": "kubernetes", "key": identity key, "api": "trainjob" | "pytorchjob",
     "name": ..., "namespace": ..., "uid": ..., "identity": {...},
     "submitted_at_epoch_s": creation time, "startup_deadline_epoch_s": float | None,
     "max_restarts": int}

Log offsets are the kubelet's timestamp of the last line passed on, in nanoseconds since the
epoch (0: from the start); see :mod:`trainforge.engines.kubernetes.logs`.
"""

from __future__ import annotations

import json
import logging
import time
from functools import cached_property
from typing import Any

from trainforge.contract import FailureKind, failure_kind
from trainforge.engines.kubernetes import names as n
from trainforge.engines.kubernetes import render as r
from trainforge.engines.kubernetes import status as s
from trainforge.engines.kubernetes.client import api_error, network_errors
from trainforge.engines.kubernetes.create import JobCreation
from trainforge.engines.kubernetes.logs import read_log
from trainforge.engines.kubernetes.pending import pending_reason
from trainforge.engines.base import (
    Backend,
    JobHandle,
    JobIdentity,
    JobState,
    JobStatus,
    LogChunk,
    TrainingJob,
)
from trainforge.errors import BackendError, JobNotFoundError

log = logging.getLogger(__name__)

#: Annotation recording why the backend deleted a failed job (JSON: message, failure, exit code).
ANN_FAILED = n.LABEL_PREFIX + "failed"


def _ended(meta: dict[str, Any]) -> JobStatus | None:
    """The FAILED status recorded on a job the backend deleted because it failed, or None."""
    raw = (meta.get("annotations") or {}).get(ANN_FAILED)
    if not raw:
        return None
    try:
        record = json.loads(raw)
        failure = FailureKind(record["failure"]) if record.get("failure") else None
        return JobStatus(JobState.FAILED, str(record["message"]), record.get("exit_code"), failure)
    except (ValueError, KeyError, TypeError):
        return None


class KubernetesBackend(JobCreation, Backend):
    """Kubeflow training jobs on a Kubernetes cluster.

    Args:
        namespace: namespace of the job and its ConfigMap.
        conn_id: Airflow connection (Kubernetes provider type) with the cluster credentials.
        kubeconfig: path of a kubeconfig file (when no connection is given).
        context: kubeconfig context (default: the file's current context).
        request_timeout_s: timeout of every API call, seconds.
        poll_interval_s: how often :meth:`cancel` checks that the job is gone, seconds.

    Every method except :meth:`render` raises :class:`~trainforge.errors.BackendError` when the
    API cannot be reached or refuses a request.
    """

    engine = "kubernetes"

    def __init__(self, namespace: str = "default", conn_id: str | None = None,
                 kubeconfig: str | None = None, context: str | None = None,
                 request_timeout_s: float = 30.0, poll_interval_s: float = 1.0):
        self.namespace = namespace
        self.conn_id = conn_id
        self.kubeconfig = kubeconfig
        self.context = context
        self.request_timeout_s = request_timeout_s
        self.poll_interval_s = poll_interval_s

    # -- pure -------------------------------------------------------------------------------
    def render(self, job: TrainingJob) -> dict[str, Any]:
        return r.render_objects(job, self.namespace)

    # -- clients ----------------------------------------------------------------------------
    @cached_property
    def _api(self) -> Any:
        from trainforge.engines.kubernetes.client import api_client

        return api_client(self.conn_id, self.kubeconfig, self.context)

    @cached_property
    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self._api)

    @cached_property
    def _custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._api)

    def _call(self, what: str, fn: Any, *args: Any, missing_ok: bool = False, raw: bool = False,
              **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with a timeout; None on 404 when ``missing_ok``; parsed JSON
        when ``raw`` (no model classes). Other API errors become :class:`BackendError`."""
        from kubernetes.client.exceptions import ApiException

        kwargs["_request_timeout"] = self.request_timeout_s
        if raw:
            kwargs["_preload_content"] = False
        try:
            result = fn(*args, **kwargs)
        except ApiException as err:
            if err.status == 404 and missing_ok:
                return None
            raise api_error(what, err) from err
        except network_errors() as err:
            raise BackendError(f"could not reach the Kubernetes API to {what}: {err}") from err
        if raw:
            return json.loads(result.data or b"null")
        return result

    # -- remote calls -----------------------------------------------------------------------
    def submit(self, job: TrainingJob) -> JobHandle:
        request = self.render(job)
        existing = self.find(job.identity)
        if existing is not None:
            log.info("Job %s already exists as %s %s/%s; re-attaching", job.identity.key,
                     existing["api"], existing["namespace"], existing["name"])
            return existing
        api, cm, obj = request["api"], request["configmap"], request["job"]
        # The API's whole validation (schema, CEL rules, fields the installed CRD lacks, RBAC's
        # create) before anything exists: a refused job leaves nothing behind.
        self._create_job(api, obj, job.identity, dry_run=True)
        self._create_configmap(cm, job.identity)
        try:
            created = self._create_job(api, obj, job.identity)
        except BaseException:
            self._delete_configmap(cm["metadata"]["name"])  # no orphan when the job is refused
            raise
        try:
            self._own_configmap(cm["metadata"]["name"], obj, created)
        except BaseException as err:
            # Refused (e.g. RBAC) after the job exists: remove what this submit created, so a
            # retry starts clean instead of adopting a job whose ConfigMap has no owner.
            log.warning("Removing %s %s/%s again: %s", obj["kind"], self.namespace,
                        obj["metadata"]["name"], err)
            try:
                self._delete({"api": api, "name": obj["metadata"]["name"],
                              "namespace": self.namespace}, propagation="Background")
            except BackendError as cleanup:
                log.error("Could not remove %s %s/%s, delete it by hand: %s", obj["kind"],
                          self.namespace, obj["metadata"]["name"], cleanup)
            raise
        handle = self._handle(api, created)
        log.info("Submitted %s %s/%s for %s (uid %s)", obj["kind"], self.namespace,
                 handle["name"], job.identity.key, handle["uid"])
        return handle

    def _get(self, api: str, name: str) -> dict[str, Any] | None:
        group, version, plural, kind = r.APIS[api]
        return self._call(f"read {kind} {self.namespace}/{name}",
                          self._custom.get_namespaced_custom_object, group, version,
                          self.namespace, plural, name, missing_ok=True)

    def find(self, identity: JobIdentity) -> JobHandle | None:
        for api in r.APIS:
            obj = self._get(api, n.resource_name(identity, api))  # None also when the cluster lacks that CRD
            if obj is not None:
                self._check_identity(obj, identity, r.APIS[api][3])
                return self._handle(api, obj)
        return None

    def _handle(self, api: str, obj: dict[str, Any]) -> JobHandle:
        meta = obj.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        identity = n.identity_from_annotations(annotations)
        submitted = s.epoch_s(meta.get("creationTimestamp")) or time.time()
        timeout = annotations.get(r.ANN_STARTUP_TIMEOUT)
        return {
            "engine": self.engine,
            "key": identity.key if identity else meta.get("name"),
            "api": api,
            "name": meta.get("name"),
            "namespace": meta.get("namespace") or self.namespace,
            "uid": meta.get("uid"),
            "identity": identity.to_dict() if identity else {},
            "submitted_at_epoch_s": submitted,
            "startup_deadline_epoch_s": submitted + float(timeout) if timeout else None,
            "max_restarts": int(annotations.get(r.ANN_MAX_RESTARTS, 0)),
        }

    def _pods(self, handle: JobHandle) -> list[dict[str, Any]]:
        # TrainJob: JobSet labels every pod with its name (the TrainJob's); PyTorchJob: our pod
        # template carries the job label.
        selector = ({"jobset.sigs.k8s.io/jobset-name": handle["name"]} if handle["api"] == "trainjob"
                    else {n.LABEL_JOB: handle["name"]})
        listing = self._call(f"list the pods of {handle['name']}", self._core.list_namespaced_pod,
                             handle["namespace"], raw=True,
                             label_selector=",".join(f"{k}={v}" for k, v in selector.items()))
        return [p for p in (listing or {}).get("items", [])
                if s.labels_match((p.get("metadata") or {}).get("labels"), selector)]

    def status(self, handle: JobHandle) -> JobStatus:
        api = handle["api"]
        obj = self._get(api, handle["name"])
        if obj is None:
            raise JobNotFoundError(f"{r.APIS[api][3]} {handle['namespace']}/{handle['name']} not "
                                   f"found (deleted, or never created)")
        meta = obj.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            ended = _ended(meta)
            if ended is not None:  # deleted by this backend because it failed
                return ended
            return JobStatus(JobState.CANCELLED, f"{r.APIS[api][3]} {handle['name']} is being deleted")
        state, cond = s.job_state(api, obj)
        pods = self._pods(handle)
        rank0 = s.rank0_pod(api, pods)
        container = r.TRAINER_CONTAINER[api]
        exit_code, result = s.rank0_termination(rank0, container)
        wall_s = s.wall_s(handle, cond, rank0)
        if state == JobState.SUCCEEDED:
            return JobStatus(JobState.SUCCEEDED, s.condition_text(cond) or "training finished",
                             exit_code, None, result, wall_s,
                             s.epoch_s((cond or {}).get("lastTransitionTime")),
                             s.phases(handle, rank0, container))
        if state == JobState.FAILED:
            kind = failure_kind(exit_code, result)
            message = (result or {}).get("message") or s.condition_text(cond)
            if (rank0 is None and (cond or {}).get("reason") == s.RESOURCES_CREATION_FAILED
                    and s.is_refusal(message)):
                kind = FailureKind.PERMANENT  # its objects were refused: a retry is refused too
            if exit_code is not None:
                message += f" (rank 0 exit code {exit_code})"
            return JobStatus(JobState.FAILED, message, exit_code, kind, result, wall_s)
        restarts = max([s.pod_restarts(p) for p in pods] or [0])
        if restarts > handle.get("max_restarts", 0):
            message = (f"{r.APIS[api][3]} {handle['name']} restarted {restarts} times, more than "
                       f"fault.max_restarts = {handle.get('max_restarts', 0)}; deleted it")
            return self._fail_and_delete(handle, JobStatus(
                JobState.FAILED, message, exit_code, FailureKind.TRANSIENT, result, wall_s))
        if state == JobState.RUNNING or (state is None and rank0 is not None and s.pod_started(rank0)):
            text = s.condition_text(cond) if cond and cond.get("type") == "Restarting" else "running"
            return JobStatus(JobState.RUNNING, text, None, None, result)
        reason, permanent = pending_reason(api, obj, cond, pods, self.namespace,
                                           self._list_events, self._list_workloads)
        if permanent and not pods:
            # The controller made no pods because the API refuses what it derives from the job
            # (a name too long, an invalid field): waiting for startup_timeout changes nothing.
            return self._fail_and_delete(handle, JobStatus(
                JobState.FAILED,
                f"{r.APIS[api][3]} {handle['name']} made no pods and was deleted: {reason}",
                None, FailureKind.PERMANENT,
            ))
        deadline = handle.get("startup_deadline_epoch_s")
        if deadline is not None and time.time() > deadline:
            timeout_s = deadline - handle.get("submitted_at_epoch_s", deadline)
            return self._fail_and_delete(handle, JobStatus(
                JobState.FAILED,
                f"{r.APIS[api][3]} {handle['name']} did not start within fault.startup_timeout "
                f"({timeout_s:.0f} s) and was deleted: {reason}",
                None, FailureKind.PERMANENT if permanent else FailureKind.TRANSIENT,
            ))
        return JobStatus(JobState.PENDING, reason)

    def _list_events(self, namespace: str, involved: str) -> list[dict[str, Any]]:
        listing = self._call(f"list the events of {involved}", self._core.list_namespaced_event,
                             namespace, raw=True, field_selector=f"involvedObject.name={involved}")
        return (listing or {}).get("items", [])

    def _list_workloads(self, version: str, namespace: str, selector: str) -> dict[str, Any] | None:
        return self._call("list Kueue workloads", self._custom.list_namespaced_custom_object,
                          "kueue.x-k8s.io", version, namespace, "workloads", missing_ok=True,
                          label_selector=selector)

    def read_logs(self, handle: JobHandle, offset: int, max_bytes: int = 65_536) -> LogChunk:
        """Rank 0's log lines after ``offset``, the kubelet timestamp (ns since the epoch) of
        the last line already passed on (:func:`~trainforge.engines.kubernetes.logs.read_log`).
        A pod restarted by JobSet or the operator is followed to its newest instance; lines of
        a replaced pod that were not read before it was replaced are not recovered."""
        rank0 = s.rank0_pod(handle["api"], self._pods(handle))
        if rank0 is None or not s.pod_started(rank0):
            return LogChunk([], offset)
        return read_log(self._api, handle["namespace"], rank0["metadata"]["name"],
                        r.TRAINER_CONTAINER[handle["api"]], offset, max_bytes,
                        self.request_timeout_s)

    def cancel(self, handle: JobHandle, grace_s: float = 30.0) -> JobStatus:
        try:
            current = self.status(handle)
        except JobNotFoundError:
            self._delete_configmap(n.configmap_name(handle["name"]), handle["namespace"])
            return JobStatus(JobState.CANCELLED, f"{handle['name']} was already deleted")
        if current.state.terminal:
            return current
        self._delete(handle)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self._get(handle["api"], handle["name"]) is None:
                return JobStatus(JobState.CANCELLED, f"{handle['name']} deleted")
            time.sleep(self.poll_interval_s)
        # Foreground deletion waits for the pods to stop; past the grace period, stop them now.
        pods = self._pods(handle)
        log.warning("%s still terminating after %.0f s; deleting its %d pods without grace",
                    handle["name"], grace_s, len(pods))
        deleted = 0
        for pod in pods:
            gone = self._call(f"delete pod {pod['metadata']['name']}",
                              self._core.delete_namespaced_pod, pod["metadata"]["name"],
                              handle["namespace"], missing_ok=True, raw=True,
                              grace_period_seconds=0)
            deleted += gone is not None
        if deleted:
            done = f"{deleted} pod{'s' if deleted != 1 else ''} force-deleted after {grace_s:.0f} s"
        else:
            done = (f"no pods left to force-delete after {grace_s:.0f} s; the cluster's garbage "
                    f"collector removes the job")
        return JobStatus(JobState.CANCELLED, f"{handle['name']} deletion requested; {done}")

    def _fail_and_delete(self, handle: JobHandle, failed: JobStatus) -> JobStatus:
        """Record why the job failed on it (so that a poll while it is being deleted still says
        FAILED and why, not cancelled), then delete it; ``failed`` back."""
        group, version, plural, kind = r.APIS[handle["api"]]
        record = {"message": failed.message,
                  "failure": failed.failure.value if failed.failure else None,
                  "exit_code": failed.exit_code}
        try:
            self._call(f"annotate {kind} {handle['namespace']}/{handle['name']}",
                       self._custom.patch_namespaced_custom_object, group, version,
                       handle["namespace"], plural, handle["name"],
                       {"metadata": {"annotations": {ANN_FAILED: json.dumps(record)}}},
                       missing_ok=True)
        except BackendError as err:  # the deletion matters more than the note
            log.warning("%s", err)
        self._delete(handle)
        return failed

    def _delete(self, handle: JobHandle, propagation: str = "Foreground") -> None:
        """Delete the job (foreground: its JobSet/pods go first) and its ConfigMap; 404 is fine."""
        from kubernetes import client

        group, version, plural, kind = r.APIS[handle["api"]]
        log.info("Deleting %s %s/%s (%s)", kind, handle["namespace"], handle["name"],
                 propagation.lower())
        self._call(f"delete {kind} {handle['namespace']}/{handle['name']}",
                   self._custom.delete_namespaced_custom_object, group, version,
                   handle["namespace"], plural, handle["name"], missing_ok=True,
                   body=client.V1DeleteOptions(propagation_policy=propagation))
        self._delete_configmap(n.configmap_name(handle["name"]), handle["namespace"])

    def _delete_configmap(self, name: str, namespace: str | None = None) -> None:
        try:
            self._call(f"delete ConfigMap {namespace or self.namespace}/{name}",
                       self._core.delete_namespaced_config_map, name, namespace or self.namespace,
                       missing_ok=True)
        except BackendError as err:
            log.warning("%s", err)
