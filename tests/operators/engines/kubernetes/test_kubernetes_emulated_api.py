"""The Kubernetes backend against an emulated Kubernetes API (kmock's in-memory API server over
HTTP on loopback): only what a real API server cannot be made to do.

Everything else runs against a real kube-apiserver in ``test_kubernetes_api_server.py``. Here:
an answer lost on the way (a create that reached the server, then a 404 from a lagging read),
a server error (HTTP 500), rank 0's log (served by the kubelet, which no test server runs) and
the trigger following a job through its log to the end, and an API that cannot be reached.
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
from trainforge.errors import BackendError, JobRefusedError
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
        if dict(request.params).get("dryRun") == "All":
            # A dry run (the backend validates before it creates anything) stores nothing.
            del kmock.objects[key]
            return data
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
async def test_a_server_error_on_create_is_transient_and_leaves_no_configmap(cluster):
    backend = cluster.backend()
    create = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS_DEMO}/trainjobs"
    def not_a_dry_run(request) -> bool:  # the dry run passes, the create fails
        return dict(request.params).get("dryRun") != "All"

    (cluster.server ** 200)["post", create, not_a_dry_run] << kmocklib.KubernetesError(
        status=500, reason="InternalError", message="etcdserver: request timed out")
    with pytest.raises(BackendError, match="HTTP 500 etcdserver: request timed out") as err:
        await run(backend.submit, demo_job("trainjob"))
    assert not isinstance(err.value, JobRefusedError)  # a retry may succeed
    assert cluster.get(CONFIGMAPS, NS_DEMO, configmap_name(NAME)) is None
