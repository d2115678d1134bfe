"""The Kubernetes backend against an emulated Kubernetes API (kmock's in-memory API server over
HTTP on loopback), with job and pod status transitions scripted by each test.

No real cluster runs here: there is no Kubeflow or Kueue controller and no kubelet. The
emulated API stores what the official client sends and serves it back; the tests play the
controllers' part by writing conditions, pods, Kueue workloads and log lines. What this proves:
the requests the backend sends (objects, owner references, foreground deletion, selectors,
log queries) and how it reads the answers. What it cannot prove: that a real Kubeflow Trainer
or training operator accepts and runs the objects (the schema tests cover their shape).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import kmock as kmocklib
import pytest
import pytest_asyncio

from trainforge.contract import FailureKind
from trainforge.engines.base import JobState
from trainforge.engines.kubernetes.names import configmap_name, resource_name
from trainforge.engines.kubernetes.backend import KubernetesBackend
from trainforge.errors import BackendError
from tests.operators.engines.kubernetes.test_kubernetes_common import IDENTITY, demo_job, full_job

NS_DEMO, NS_FULL = "default", "ml-train"
TRAINJOBS = "trainer.kubeflow.org/v1alpha1/trainjobs"
PYTORCHJOBS = "kubeflow.org/v1/pytorchjobs"
PODS, CONFIGMAPS, EVENTS = "v1/pods", "v1/configmaps", "v1/events"
WORKLOADS = "kueue.x-k8s.io/v1beta2/workloads"
NAME = resource_name(IDENTITY)


def _rfc3339(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


class Cluster:
    """The emulated API plus the test's hand on what controllers and the kubelet would do."""

    def __init__(self, server, tmp_path):
        self.server = server
        self.logs: dict[str, list[tuple[int, str]]] = {}
        url = str(server.servers[0].url).rstrip("/")
        self.kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulated",
            "clusters": [{"name": "emulated", "cluster": {"server": url}}],
            "users": [{"name": "tester", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "emulated", "context": {"cluster": "emulated", "user": "tester"}}],
        }
        self.kubeconfig_path = tmp_path / "kubeconfig"
        self.kubeconfig_path.write_text(json.dumps(self.kubeconfig))

    def backend(self, namespace: str = NS_DEMO) -> KubernetesBackend:
        return KubernetesBackend(namespace=namespace, kubeconfig=str(self.kubeconfig_path),
                                 request_timeout_s=10, poll_interval_s=0.1)

    def get(self, resource: str, namespace: str, name: str) -> dict | None:
        try:
            obj = self.server.objects[resource, namespace, name]
        except KeyError:
            return None
        return None if obj.deleted else obj.raw

    def patch(self, resource: str, namespace: str, name: str, changes: dict) -> None:
        self.server.objects[resource, namespace, name].patch(changes)

    def conditions(self, resource: str, namespace: str, name: str, *conds: tuple) -> None:
        """Set the job's conditions: (type, status, reason, message) tuples, all now."""
        now = _rfc3339(time.time())
        self.patch(resource, namespace, name, {"status": {"conditions": [
            {"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": now}
            for t, s, r, m in conds]}})

    def pod(self, namespace: str, name: str, labels: dict, phase: str, container: str,
            state: dict | None = None, conditions: list | None = None, restarts: int = 0,
            created: float | None = None) -> None:
        self.server.objects[PODS, namespace, name] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "creationTimestamp": _rfc3339(created or time.time())},
            "status": {"phase": phase, "conditions": conditions or [],
                       "containerStatuses": [{"name": container, "restartCount": restarts,
                                              "state": state or {}}]},
        }

    def event(self, namespace: str, kind: str, name: str, reason: str, message: str,
              type_: str = "Warning") -> None:
        """A controller's event about object ``kind``/``name`` (core/v1 Event)."""
        event_name = f"{name}.{uuid.uuid4().hex[:16]}"
        self.server.objects[EVENTS, namespace, event_name] = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": event_name, "namespace": namespace},
            "involvedObject": {"kind": kind, "name": name, "namespace": namespace},
            "type": type_, "reason": reason, "message": message, "count": 1,
            "lastTimestamp": _rfc3339(time.time()),
        }

    def requests(self, method: str, path_re: str) -> list:
        return [r for r in list(self.server)
                if str(r.method).lower().endswith(method) and re.search(path_re, r.url.path)]


@pytest_asyncio.fixture
async def cluster(kmock, tmp_path):
    for resource in (TRAINJOBS, PYTORCHJOBS, PODS, CONFIGMAPS, WORKLOADS, EVENTS):
        kmock.resources[resource] = {}

    def stamp(request):
        # What the API server adds on create: a uid and the creation time.
        data = request.data or {}
        key = (request.resource, request.namespace or data.get("metadata", {}).get("namespace"),
               data.get("metadata", {}).get("name"))
        if not kmock.objects[key].get("metadata", {}).get("uid"):
            kmock.objects[key].patch({"metadata": {"uid": str(uuid.uuid4()),
                                                   "creationTimestamp": _rfc3339(time.time())}})
        return kmock.objects[key].raw

    # The real API answers a create with 201 Created and the stored object (the client reads
    # only a 201 body); the emulator has already stored the object (or answered 409) by now.
    kmock[kmocklib.action.CREATE] << 201 << stamp
    the_cluster = Cluster(kmock, tmp_path)

    def pod_log(request):
        # The kubelet's side of GET .../pods/<name>/log: timestamps, sinceTime, limitBytes.
        params = dict(request.params)
        since = params.get("sinceTime")
        since_ns = 0
        if since:
            since_ns = int(time.mktime(time.strptime(since, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone) * 10**9
        out = b""
        for ts, text in the_cluster.logs.get(request.name, []):
            if ts >= since_ns:
                stamp_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts // 10**9))
                out += f"{stamp_text}.{ts % 10**9:09d}Z {text}\n".encode()
        if "limitBytes" in params:
            out = out[: int(params["limitBytes"])]
        return out

    kmock["get", re.compile(r"^/api/v1/namespaces/[^/]+/pods/[^/]+/log$")] << pod_log
    return the_cluster


def run(fn, *args, **kwargs):
    """The backend is blocking I/O: call it in a thread, as the trigger does."""
    return asyncio.to_thread(fn, *args, **kwargs)


TRAINJOB_RANK0 = {"jobset.sigs.k8s.io/jobset-name": NAME, "jobset.sigs.k8s.io/replicatedjob-name": "node",
                  "batch.kubernetes.io/job-completion-index": "0"}
TORCHJOB_RANK0 = {"trainforge.io/job": NAME, "training.kubeflow.org/replica-type": "master",
                  "training.kubeflow.org/replica-index": "0"}


@pytest.mark.asyncio
async def test_submit_creates_configmap_then_job_owned_and_reattaches(cluster):
    backend = cluster.backend()
    job = demo_job("trainjob")
    handle = await run(backend.submit, job)
    obj = cluster.get(TRAINJOBS, NS_DEMO, NAME)
    cm = cluster.get(CONFIGMAPS, NS_DEMO, configmap_name(NAME))
    assert obj["spec"] == backend.render(job)["job"]["spec"]
    assert json.loads(cm["data"]["job.json"]) == job.config
    owner = cm["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("TrainJob", NAME, obj["metadata"]["uid"])
    posts = [r.url.path for r in cluster.requests("post", "")]
    assert posts == [f"/api/v1/namespaces/{NS_DEMO}/configmaps",
                     f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS_DEMO}/trainjobs"]
    assert handle["api"] == "trainjob" and handle["uid"] == obj["metadata"]["uid"]
    assert handle["identity"] == IDENTITY.to_dict()
    assert handle["startup_deadline_epoch_s"] == pytest.approx(handle["submitted_at_epoch_s"] + 600, abs=1)
    assert json.loads(json.dumps(handle)) == handle  # JSON-able for XCom and the trigger

    # A retry finds the job and sends nothing new.
    assert await run(backend.find, IDENTITY) == handle
    assert await run(backend.submit, job) == handle
    assert len(cluster.requests("post", "")) == 2


@pytest.mark.asyncio
async def test_409_on_create_adopts_a_job_with_the_same_identity(cluster):
    backend = cluster.backend()
    job = demo_job("trainjob")
    # The earlier create reached the server but its answer was lost; this call's find() ran
    # before the object became visible (one 404), so create answers 409 AlreadyExists.
    cluster.server.objects[TRAINJOBS, NS_DEMO, NAME] = {
        **backend.render(job)["job"], "metadata": {**backend.render(job)["job"]["metadata"],
                                                   "uid": "uid-1", "creationTimestamp": _rfc3339(time.time())}}
    misses = iter([kmocklib.KubernetesObjectNotFoundError])
    cluster.server["get", f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS_DEMO}/trainjobs/{NAME}"] << (
        lambda: next(misses, None))
    handle = await run(backend.submit, job)
    assert handle["uid"] == "uid-1"
    cm = cluster.get(CONFIGMAPS, NS_DEMO, configmap_name(NAME))
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


@pytest.mark.asyncio
async def test_409_with_a_foreign_job_fails_and_leaves_no_configmap(cluster):
    backend = cluster.backend()
    job = demo_job("trainjob")
    foreign = backend.render(job)["job"]
    foreign["metadata"]["annotations"] = {"trainforge.io/dag-id": "other", "trainforge.io/run-id": "r",
                                          "trainforge.io/task-id": "t", "trainforge.io/try-number": "1"}
    cluster.server.objects[TRAINJOBS, NS_DEMO, NAME] = foreign
    with pytest.raises(BackendError, match="belongs to"):
        await run(backend.submit, job)
    assert cluster.get(CONFIGMAPS, NS_DEMO, configmap_name(NAME)) is None


@pytest.mark.asyncio
async def test_trainjob_status_transitions_from_conditions(cluster):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("trainjob"))
    status = await run(backend.status, handle)
    assert status.state == JobState.PENDING and "no pods created yet" in status.message

    cluster.pod(NS_DEMO, f"{NAME}-node-0-0-abcde", TRAINJOB_RANK0, "Pending", "node", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}])
    status = await run(backend.status, handle)
    assert status.state == JobState.PENDING
    assert "Unschedulable: 0/4 nodes are available" in status.message

    cluster.pod(NS_DEMO, f"{NAME}-node-0-0-abcde", TRAINJOB_RANK0, "Running", "node",
                state={"running": {"startedAt": _rfc3339(time.time())}})
    assert (await run(backend.status, handle)).state == JobState.RUNNING

    result = {"status": "success", "exit_code": 0, "message": "finished at step 300", "final_step": 300}
    cluster.pod(NS_DEMO, f"{NAME}-node-0-0-abcde", TRAINJOB_RANK0, "Succeeded", "node",
                state={"terminated": {"exitCode": 0, "message": json.dumps(result)}})
    # The pod alone does not decide the outcome: without the Complete condition it still runs.
    assert (await run(backend.status, handle)).state == JobState.RUNNING
    cluster.conditions(TRAINJOBS, NS_DEMO, NAME, ("Complete", "True", "JobSetCompleted", "done"))
    status = await run(backend.status, handle)
    assert (status.state, status.exit_code, status.result) == (JobState.SUCCEEDED, 0, result)
    assert status.wall_s is not None

    # ...and a job that completed is still succeeded after its pods are gone.
    del cluster.server.objects[PODS, NS_DEMO, f"{NAME}-node-0-0-abcde"]
    assert (await run(backend.status, handle)).state == JobState.SUCCEEDED


@pytest.mark.asyncio
@pytest.mark.parametrize("result,exit_code,kind", [
    ({"status": "bad_config", "exit_code": 78, "message": "dataset manifest missing"}, 1,
     FailureKind.PERMANENT),
    ({"status": "diverged", "exit_code": 79, "message": "loss is nan at step 12"}, 1,
     FailureKind.PERMANENT),
    ({"status": "error", "exit_code": 1, "message": "RuntimeError: NCCL timeout"}, 1,
     FailureKind.TRANSIENT),
    (None, 137, FailureKind.TRANSIENT),
])
async def test_pytorchjob_failure_kind_from_rank0_exit(cluster, result, exit_code, kind):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("pytorchjob"))
    cluster.conditions(PYTORCHJOBS, NS_DEMO, NAME, ("Created", "True", "Created", ""),
                       ("Running", "False", "", ""),
                       ("Failed", "True", "PyTorchJobFailed", "job failed"))
    term = {"exitCode": exit_code, **({"message": json.dumps(result)} if result else {})}
    cluster.pod(NS_DEMO, f"{NAME}-master-0", TORCHJOB_RANK0, "Failed", "pytorch",
                state={"terminated": term})
    status = await run(backend.status, handle)
    assert (status.state, status.failure, status.exit_code) == (JobState.FAILED, kind, exit_code)
    assert (result or {}).get("message", "PyTorchJobFailed") in status.message


@pytest.mark.asyncio
async def test_startup_timeout_reports_kueue_reason_and_deletes_everything(cluster):
    backend = cluster.backend(NS_FULL)
    handle = await run(backend.submit, full_job("trainjob"))
    cluster.conditions(TRAINJOBS, NS_FULL, NAME, ("Suspended", "True", "Suspended", "suspended"))
    cluster.server.objects[WORKLOADS, NS_FULL, f"trainjob-{NAME}-1a2b3"] = {
        "metadata": {"name": f"trainjob-{NAME}-1a2b3", "namespace": NS_FULL,
                     "labels": {"kueue.x-k8s.io/job-uid": handle["uid"]}},
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                   "message": "couldn't assign flavors to pod set node: insufficient "
                                              "quota for nvidia.com/gpu in flavor h100"}]},
    }
    status = await run(backend.status, handle)
    assert status.state == JobState.PENDING
    assert "QuotaReserved=False (Pending): couldn't assign flavors" in status.message

    # A retry re-attaches after the startup timeout has passed (the job was created 16 min ago).
    cluster.patch(TRAINJOBS, NS_FULL, NAME, {"metadata": {"creationTimestamp": _rfc3339(time.time() - 960)}})
    late = await run(backend.find, IDENTITY)
    status = await run(backend.status, late)
    assert status.state == JobState.FAILED and status.failure == FailureKind.TRANSIENT
    assert "did not start within fault.startup_timeout (900 s)" in status.message
    assert "insufficient quota for nvidia.com/gpu" in status.message
    assert cluster.get(TRAINJOBS, NS_FULL, NAME) is None
    assert cluster.get(CONFIGMAPS, NS_FULL, configmap_name(NAME)) is None
    deletes = cluster.requests("delete", f"/trainjobs/{NAME}$")
    assert deletes and deletes[0].data["propagationPolicy"] == "Foreground"


@pytest.mark.asyncio
@pytest.mark.parametrize("reason,permanent", [("ImagePullBackOff", False), ("InvalidImageName", True)])
async def test_startup_timeout_with_image_errors(cluster, reason, permanent):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("pytorchjob"))
    cluster.conditions(PYTORCHJOBS, NS_DEMO, NAME, ("Created", "True", "PyTorchJobCreated", ""))
    cluster.pod(NS_DEMO, f"{NAME}-master-0", TORCHJOB_RANK0, "Pending", "pytorch",
                state={"waiting": {"reason": reason, "message": 'Back-off pulling image "x"'}})
    status = await run(backend.status, handle)
    assert status.state == JobState.PENDING and reason in status.message
    status = await run(backend.status, {**handle, "startup_deadline_epoch_s": time.time() - 1})
    assert status.state == JobState.FAILED and reason in status.message
    assert status.failure == (FailureKind.PERMANENT if permanent else FailureKind.TRANSIENT)
    assert cluster.get(PYTORCHJOBS, NS_DEMO, NAME) is None


@pytest.mark.asyncio
async def test_restarting_beyond_the_limit_fails_and_deletes(cluster):
    backend = cluster.backend(NS_FULL)
    handle = await run(backend.submit, full_job("trainjob"))  # fault.max_restarts = 2
    labels = {**TRAINJOB_RANK0, "jobset.sigs.k8s.io/restart-attempt": "2"}
    cluster.pod(NS_FULL, f"{NAME}-node-0-0-a", labels, "Running", "node", state={"running": {}})
    # Another job's pod in the namespace does not count (the selector is the job's own).
    cluster.pod(NS_FULL, "other-node-0-0-a", {**labels, "jobset.sigs.k8s.io/jobset-name": "other",
                                              "jobset.sigs.k8s.io/restart-attempt": "9"},
                "Running", "node", state={"running": {}})
    assert (await run(backend.status, handle)).state == JobState.RUNNING  # 2 restarts: allowed
    cluster.pod(NS_FULL, f"{NAME}-node-0-0-a", {**labels, "jobset.sigs.k8s.io/restart-attempt": "3"},
                "Running", "node", state={"running": {}})
    status = await run(backend.status, handle)
    assert status.state == JobState.FAILED and status.failure == FailureKind.TRANSIENT
    assert "restarted 3 times, more than fault.max_restarts = 2" in status.message
    assert cluster.get(TRAINJOBS, NS_FULL, NAME) is None


@pytest.mark.asyncio
async def test_logs_follow_rank0_incrementally_and_bounded(cluster):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("trainjob"))
    assert (await run(backend.read_logs, handle, 0)).lines == []  # no pod yet
    pod = f"{NAME}-node-0-0-abcde"
    cluster.pod(NS_DEMO, pod, TRAINJOB_RANK0, "Running", "node", state={"running": {}})
    cluster.pod(NS_DEMO, f"{NAME}-node-0-1-fghij", {**TRAINJOB_RANK0,
                "batch.kubernetes.io/job-completion-index": "1"}, "Running", "node")
    base = int(time.time()) * 10**9
    cluster.logs[pod] = [(base + i * 1000, f"step {i} loss {5 - i * 0.01:.2f}") for i in range(50)]
    cluster.logs[f"{NAME}-node-0-1-fghij"] = [(base, "rank 1 must not show up")]
    seen, offset = [], 0
    for _ in range(20):
        chunk = await run(backend.read_logs, handle, offset, 100)
        assert sum(len(line) + 1 for line in chunk.lines) <= 100
        seen += chunk.lines
        if not chunk.lines:
            break
        offset = chunk.next_offset
    assert seen == [text for _, text in cluster.logs[pod]]
    cluster.logs[pod].append((base + 10**9 + 5, "step 50 loss 4.50"))
    chunk = await run(backend.read_logs, handle, offset)
    assert chunk.lines == ["step 50 loss 4.50"]
    log_requests = cluster.requests("get", f"/pods/{pod}/log$")
    assert log_requests[-1].params["timestamps"] == "true" and "sinceTime" in log_requests[-1].params
    assert all(r.params["container"] == "node" for r in log_requests)


@pytest.mark.asyncio
async def test_cancel_deletes_foreground_and_is_idempotent(cluster):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("pytorchjob"))
    status = await run(backend.cancel, handle, 5)
    assert status.state == JobState.CANCELLED
    delete = cluster.requests("delete", f"/pytorchjobs/{NAME}$")
    assert [r.data["propagationPolicy"] for r in delete] == ["Foreground"]
    assert cluster.get(PYTORCHJOBS, NS_DEMO, NAME) is None
    assert cluster.get(CONFIGMAPS, NS_DEMO, configmap_name(NAME)) is None
    again = await run(backend.cancel, handle, 5)  # 404 is fine
    assert again.state == JobState.CANCELLED


@pytest.mark.asyncio
async def test_cancel_force_deletes_pods_after_the_grace_period(cluster):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("trainjob"))
    # Foreground deletion: the API keeps the job (finalizer) until its pods are gone.
    cluster.patch(TRAINJOBS, NS_DEMO, NAME, {"metadata": {"finalizers": ["foregroundDeletion"]}})
    cluster.pod(NS_DEMO, f"{NAME}-node-0-0-abcde", TRAINJOB_RANK0, "Running", "node", state={"running": {}})
    started = time.monotonic()
    status = await run(backend.cancel, handle, 1.0)
    assert status.state == JobState.CANCELLED and "force-deleted" in status.message
    assert 1.0 <= time.monotonic() - started < 10
    pod_deletes = cluster.requests("delete", f"/pods/{NAME}-node-0-0-abcde$")
    assert pod_deletes and pod_deletes[0].params.get("gracePeriodSeconds") == "0"
    # Being deleted reads as cancelled, not as a failure.
    assert (await run(backend.status, handle)).state == JobState.CANCELLED


@pytest.mark.asyncio
async def test_cancel_leaves_a_finished_job_alone(cluster):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("trainjob"))
    cluster.conditions(TRAINJOBS, NS_DEMO, NAME, ("Complete", "True", "JobSetCompleted", "done"))
    assert (await run(backend.cancel, handle, 1)).state == JobState.SUCCEEDED
    assert cluster.get(TRAINJOBS, NS_DEMO, NAME) is not None


@pytest.mark.asyncio
async def test_airflow_connection_with_inline_kubeconfig(cluster, monkeypatch):
    conn = {"conn_type": "kubernetes",
            "extra": {"kube_config": json.dumps(cluster.kubeconfig), "cluster_context": "emulated"}}
    monkeypatch.setenv("AIRFLOW_CONN_K8S_EMULATED", json.dumps(conn))
    backend = KubernetesBackend(namespace=NS_DEMO, conn_id="k8s_emulated", request_timeout_s=10)
    assert await run(backend.find, IDENTITY) is None
    handle = await run(backend.submit, demo_job("trainjob"))
    assert handle["name"] == NAME


@pytest.mark.asyncio
async def test_unreachable_api_is_a_backend_error(tmp_path):
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u"}}]}))
    backend = KubernetesBackend(kubeconfig=str(config), request_timeout_s=2)
    with pytest.raises(BackendError, match="could not reach the Kubernetes API"):
        await run(backend.find, IDENTITY)


@pytest.mark.asyncio
async def test_training_trigger_follows_a_kubernetes_job_to_success(cluster, monkeypatch):
    """The deferred wait as the triggerer runs it: live rank-0 log lines, then one success event."""
    from trainforge.triggers import TrainingJobTrigger

    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("trainjob"))
    trigger = TrainingJobTrigger(
        engine="kubernetes", handle=handle, poll_interval_s=0.5,
        backend_kwargs={"namespace": NS_DEMO, "conn_id": None,
                        "kubeconfig": str(cluster.kubeconfig_path), "context": None})
    pod = f"{NAME}-node-0-0-abcde"

    async def controllers():
        await asyncio.sleep(0.6)
        cluster.pod(NS_DEMO, pod, TRAINJOB_RANK0, "Running", "node", state={"running": {}})
        now = int(time.time()) * 10**9
        cluster.logs[pod] = [(now, "step 10 loss 4.10"), (now + 1, "step 20 loss 3.90")]
        await asyncio.sleep(1.2)
        result = {"status": "success", "exit_code": 0, "message": "finished at step 300"}
        cluster.pod(NS_DEMO, pod, TRAINJOB_RANK0, "Succeeded", "node",
                    state={"terminated": {"exitCode": 0, "message": json.dumps(result)}})
        cluster.logs[pod].append((now + 2, "finished at step 300"))
        cluster.conditions(TRAINJOBS, NS_DEMO, NAME, ("Complete", "True", "JobSetCompleted", "done"))

    # What the trigger writes to the task log, caught by a plain logger of this test.
    import logging

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    logger, caught = logging.getLogger("tests.kubernetes.trigger"), Lines()
    logger.setLevel(logging.INFO)
    logger.addHandler(caught)
    monkeypatch.setattr(TrainingJobTrigger, "log", property(lambda self: logger))
    script = asyncio.create_task(controllers())
    event = await asyncio.wait_for(anext(trigger.run()), timeout=30)
    await script
    assert event.payload["status"] == "success", event.payload
    assert event.payload["exit_code"] == 0 and event.payload["result"]["status"] == "success"
    logger.removeHandler(caught)
    shown = [line for line in caught.lines if line.startswith(f"[{NAME}]")]
    assert shown == [f"[{NAME}] step 10 loss 4.10", f"[{NAME}] step 20 loss 3.90",
                     f"[{NAME}] finished at step 300"]


@pytest.mark.asyncio
async def test_suspended_without_rights_on_kueue_workloads_still_reports_pending(cluster):
    backend = cluster.backend(NS_FULL)
    handle = await run(backend.submit, full_job("pytorchjob"))
    cluster.server.objects[WORKLOADS, NS_FULL, "w"] = {
        "metadata": {"name": "w", "namespace": NS_FULL,
                     "labels": {"kueue.x-k8s.io/job-uid": handle["uid"]}},
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                   "message": "insufficient quota"}]}}
    assert "insufficient quota" in (await run(backend.status, handle)).message
    cluster.server["get", re.compile(r"^/apis/kueue.x-k8s.io/[^/]+/namespaces/[^/]+/workloads$")] << kmocklib.KubernetesError(
        status=403, reason="Forbidden", message="workloads is forbidden")
    status = await run(backend.status, handle)
    assert status.state == JobState.PENDING
    assert status.message == "suspended: waiting for Kueue to admit it from LocalQueue 'team-a'"


# What the controllers say when they cannot make a job's pods (messages as the API words them).
JOBSET_REFUSED = (
    'TrainJob resources reconciliation failed: admission webhook "vjobset.kb.io" denied the '
    'request: spec.replicatedJobs[0]: Invalid value: "x-node-0-1-abcde": must be no more than '
    '63 characters')
POD_REFUSED = ('Error creating: Pod "x-worker-11" is invalid: metadata.name: Invalid value: '
               '"x-worker-11": must be no more than 63 characters')
QUOTA = ('Error creating: pods "x-master-0" is forbidden: exceeded quota: gpu-quota, requested: '
         'nvidia.com/gpu=8, used: nvidia.com/gpu=8, limited: nvidia.com/gpu=8')


@pytest.mark.asyncio
@pytest.mark.parametrize("api,kind,name,reason,message", [
    ("trainjob", "TrainJob", NAME, "TrainJobResourcesCreationFailed", JOBSET_REFUSED),
    ("trainjob", "Job", f"{NAME}-node-0", "FailedCreate", POD_REFUSED),
    ("pytorchjob", "PyTorchJob", NAME, "FailedCreatePod", POD_REFUSED),
])
async def test_a_job_whose_controller_cannot_make_pods_fails_permanently_with_its_reason(
        cluster, api, kind, name, reason, message):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job(api))
    assert (await run(backend.status, handle)).state == JobState.PENDING
    cluster.event(NS_DEMO, kind, name, reason, message)
    cluster.event(NS_DEMO, kind, "another-job", reason, "not this job's")
    status = await run(backend.status, handle)  # long before fault.startup_timeout
    assert (status.state, status.failure) == (JobState.FAILED, FailureKind.PERMANENT)
    assert f"{kind} {name} {reason}: " in status.message
    assert "must be no more than 63 characters" in status.message
    assert cluster.get(TRAINJOBS if api == "trainjob" else PYTORCHJOBS, NS_DEMO, NAME) is None


@pytest.mark.asyncio
async def test_a_creation_failure_that_may_clear_up_is_the_pending_reason(cluster):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("pytorchjob"))
    cluster.event(NS_DEMO, "PyTorchJob", NAME, "FailedCreatePod", QUOTA)
    status = await run(backend.status, handle)
    assert status.state == JobState.PENDING and "exceeded quota: gpu-quota" in status.message
    status = await run(backend.status, {**handle, "startup_deadline_epoch_s": time.time() - 1})
    assert (status.state, status.failure) == (JobState.FAILED, FailureKind.TRANSIENT)
    assert "exceeded quota: gpu-quota" in status.message


@pytest.mark.asyncio
async def test_a_trainjob_failed_because_its_objects_were_refused_is_permanent(cluster):
    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("trainjob"))
    cluster.conditions(TRAINJOBS, NS_DEMO, NAME,
                       ("Failed", "True", "ResourcesCreationFailed", JOBSET_REFUSED))
    status = await run(backend.status, handle)
    assert (status.state, status.failure) == (JobState.FAILED, FailureKind.PERMANENT)
    assert "must be no more than 63 characters" in status.message


@pytest.mark.asyncio
async def test_a_job_the_api_refuses_is_a_permanent_error_and_leaves_no_configmap(cluster):
    from trainforge.errors import JobRefusedError

    backend = cluster.backend()
    # Ahead of the emulator's own create reaction (priority 100): the API server's validation.
    create = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS_DEMO}/trainjobs"
    (cluster.server ** 100)["post", create] << kmocklib.KubernetesError(
        status=422, reason="Invalid",
        message=f'TrainJob.trainer.kubeflow.org "{NAME}" is invalid: spec.trainer.numNodes: '
                f'Invalid value: 0: must be greater than or equal to 1')
    with pytest.raises(JobRefusedError, match="HTTP 422 .* is invalid: spec.trainer.numNodes"):
        await run(backend.submit, demo_job("trainjob"))
    assert cluster.get(CONFIGMAPS, NS_DEMO, configmap_name(NAME)) is None
