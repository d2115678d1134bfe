"""The Kubernetes backend against a real kube-apiserver (``tests/kube_apiserver.py``): the
upstream TrainJob, PyTorchJob and Kueue CRDs, RBAC, strict field validation, CEL rules and
``OwnerReferencesPermissionEnforcement``.

No controllers run there. Where a test needs one, it does its part through the API and says so:
the Kubeflow Trainer or training operator writing a job's conditions (status subresource), the
kubelet writing a pod's status, a controller recording an event, Kueue writing a Workload, and
the garbage collector finishing a foreground deletion (removing the ``foregroundDeletion``
finalizer). Logs need a kubelet: they stay in ``test_kubernetes_emulated_api.py``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainforge.contract import FailureKind
from trainforge.engines.base import JobState
from trainforge.engines.kubernetes import render as r
from trainforge.engines.kubernetes.backend import ANN_FAILED, KubernetesBackend
from trainforge.engines.kubernetes.names import configmap_name, resource_name
from trainforge.errors import BackendError, JobRefusedError
from tests.operators.engines.kubernetes.test_kubernetes_common import (
    IDENTITY,
    ROOT,
    demo_job,
    full_job,
    job_for,
    spec_for,
)
from trainforge.engines.base import JobIdentity

NS_DEMO, NS_FULL = "default", "ml-train"
NAME = resource_name(IDENTITY)
APIS = ("trainjob", "pytorchjob")
RANK0 = {"trainjob": {"jobset.sigs.k8s.io/jobset-name": NAME, "jobset.sigs.k8s.io/replicatedjob-name": "node",
                      "batch.kubernetes.io/job-completion-index": "0"},
         "pytorchjob": {"trainforge.io/job": NAME, "training.kubeflow.org/replica-type": "master",
                        "training.kubeflow.org/replica-index": "0"}}
POD0 = {"trainjob": f"{NAME}-node-0-0-abcde", "pytorchjob": f"{NAME}-master-0"}
DONE = {"trainjob": ("Complete", "True", "JobSetCompleted", "done"),
        "pytorchjob": ("Succeeded", "True", "PyTorchJobSucceeded", "done")}


def _rfc3339(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


def holds(stored: Any, sent: Any) -> bool:
    """Whether ``stored`` has everything of ``sent`` (the server may add its defaults)."""
    if isinstance(sent, dict):
        return isinstance(stored, dict) and all(k in stored and holds(stored[k], v) for k, v in sent.items())
    if isinstance(sent, list):
        return isinstance(stored, list) and len(stored) == len(sent) and all(map(holds, stored, sent))
    return stored == sent


def documented_role() -> list[dict[str, Any]]:
    """The rules of the Role docs/kubernetes.md gives the Airflow side, as written there."""
    text = (ROOT / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    section = text.split("### Permissions of the Airflow side", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    return yaml.safe_load(block)["rules"]


class Cluster:
    """Admin access to the test API server, and the test's hand on what controllers would do."""

    def __init__(self, server):
        from kubernetes import client

        self.server = server
        api = server.client()
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

    def backend(self, namespace: str = NS_DEMO, kubeconfig: Path | None = None) -> KubernetesBackend:
        return KubernetesBackend(namespace=namespace, kubeconfig=str(kubeconfig or self.server.kubeconfig),
                                 request_timeout_s=10, poll_interval_s=0.1)

    def get(self, api: str, namespace: str, name: str = NAME) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        group, version, plural, _ = r.APIS[api]
        try:
            return self.custom.get_namespaced_custom_object(group, version, namespace, plural, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def configmap(self, namespace: str, name: str = configmap_name(NAME)) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.core.read_namespaced_config_map(name, namespace).to_dict()
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def conditions(self, api: str, namespace: str, *conds: tuple, name: str = NAME) -> None:
        """The job controller's part: set the job's conditions (type, status, reason, message)."""
        group, version, plural, _ = r.APIS[api]
        now = _rfc3339(time.time())
        self.custom.patch_namespaced_custom_object_status(group, version, namespace, plural, name, {
            "status": {"conditions": [{"type": t, "status": s, "reason": rs, "message": m,
                                       "lastTransitionTime": now} for t, s, rs, m in conds]}})

    def pod(self, namespace: str, name: str, labels: dict, phase: str, container: str,
            state: dict | None = None, conditions: list | None = None, restarts: int = 0) -> None:
        """The job controller's part (the pod) and the kubelet's (its status)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.create_namespaced_pod(namespace, {
                "metadata": {"name": name, "labels": labels},
                "spec": {"containers": [{"name": container, "image": "trainer"}]}})
        except ApiException as err:
            if err.status != 409:
                raise
            self.core.patch_namespaced_pod(name, namespace, {"metadata": {"labels": labels}})
        self.core.patch_namespaced_pod_status(name, namespace, {"status": {
            "phase": phase, "conditions": conditions or [],
            "containerStatuses": [{"name": container, "restartCount": restarts, "ready": False,
                                   "image": "trainer", "imageID": "", "state": state or {}}]}})

    def event(self, namespace: str, kind: str, name: str, reason: str, message: str) -> None:
        """A controller's Warning event about ``kind``/``name``."""
        self.core.create_namespaced_event(namespace, {
            "metadata": {"generateName": f"{name}."},
            "involvedObject": {"kind": kind, "name": name, "namespace": namespace},
            "type": "Warning", "reason": reason, "message": message, "count": 1,
            "firstTimestamp": _rfc3339(time.time()), "lastTimestamp": _rfc3339(time.time())})

    def workload(self, namespace: str, job_uid: str, conditions: list[dict]) -> None:
        """Kueue's part: the job's Workload and why it is not admitted."""
        name = f"trainjob-{NAME}-1a2b3"
        self.custom.create_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", namespace, "workloads", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": name, "labels": {"kueue.x-k8s.io/job-uid": job_uid}},
            "spec": {"queueName": "team-a", "podSets": [{"name": "node", "count": 1, "template": {
                "spec": {"containers": [{"name": "node", "image": "trainer"}]}}}]}})
        now = _rfc3339(time.time())
        self.custom.patch_namespaced_custom_object_status(
            "kueue.x-k8s.io", "v1beta2", namespace, "workloads", name,
            {"status": {"conditions": [{**c, "lastTransitionTime": now} for c in conditions]}})

    def collect_garbage(self, api: str, namespace: str, name: str = NAME) -> None:
        """The garbage collector's part in a foreground deletion: the dependents are gone, so
        the ``foregroundDeletion`` finalizer comes off and the job disappears."""
        group, version, plural, _ = r.APIS[api]
        if self.get(api, namespace, name) is not None:
            self.custom.patch_namespaced_custom_object(group, version, namespace, plural, name,
                                                       {"metadata": {"finalizers": None}})

    def wipe(self) -> None:
        """Remove what a test left in the namespaces."""
        for ns in (NS_DEMO, NS_FULL):
            for api in APIS:
                group, version, plural, _ = r.APIS[api]
                for obj in self.custom.list_namespaced_custom_object(group, version, ns, plural)["items"]:
                    name = obj["metadata"]["name"]
                    if obj["metadata"].get("deletionTimestamp"):
                        self.collect_garbage(api, ns, name)
                    else:  # background: no finalizer waits for a garbage collector
                        self.custom.delete_namespaced_custom_object(
                            group, version, ns, plural, name, propagation_policy="Background")
            self.core.delete_collection_namespaced_config_map(ns)
            self.core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
            self.core.delete_collection_namespaced_event(ns)
            self.custom.delete_collection_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", ns,
                                                                    "workloads")


@pytest.fixture
def cluster(kube_apiserver):
    the_cluster = Cluster(kube_apiserver)
    yield the_cluster
    the_cluster.wipe()


# -- submit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("api", APIS)
def test_submit_creates_configmap_then_job_owned_and_reattaches(cluster, api):
    backend = cluster.backend()
    job = demo_job(api)
    handle = backend.submit(job)
    obj, cm = cluster.get(api, NS_DEMO), cluster.configmap(NS_DEMO)
    rendered = backend.render(job)["job"]
    assert holds(obj["spec"], rendered["spec"])  # stored intact: nothing dropped
    assert json.loads(cm["data"]["job.json"]) == job.config
    owner = cm["metadata"]["owner_references"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (rendered["kind"], NAME, obj["metadata"]["uid"])
    assert not owner.get("block_owner_deletion")
    assert handle["api"] == api and handle["uid"] == obj["metadata"]["uid"]
    assert handle["identity"] == IDENTITY.to_dict()
    assert handle["startup_deadline_epoch_s"] == pytest.approx(handle["submitted_at_epoch_s"] + 600, abs=1)
    assert json.loads(json.dumps(handle)) == handle  # JSON-able for XCom and the trigger

    # A retry finds the job and creates nothing new.
    assert backend.find(IDENTITY) == handle
    assert backend.submit(job) == handle
    assert cluster.get(api, NS_DEMO)["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_the_full_example_is_stored_intact(cluster):
    backend = cluster.backend(NS_FULL)
    for api in APIS:
        job = full_job(api)
        backend.submit(job)
        assert holds(cluster.get(api, NS_FULL)["spec"], backend.render(job)["job"]["spec"])
        cluster.wipe()


def test_an_existing_job_of_another_identity_fails_and_leaves_no_configmap(cluster):
    backend = cluster.backend()
    job = demo_job("trainjob")
    foreign = backend.render(job)["job"]
    foreign["metadata"]["annotations"] = {"trainforge.io/dag-id": "other", "trainforge.io/run-id": "r",
                                          "trainforge.io/task-id": "t", "trainforge.io/try-number": "1"}
    cluster.custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", NS_DEMO,
                                                   "trainjobs", foreign)
    with pytest.raises(BackendError, match="belongs to"):
        backend.submit(job)
    assert cluster.configmap(NS_DEMO) is None


@pytest.mark.parametrize("api", APIS)
def test_4096_nodes_and_a_long_dag_id_are_accepted(cluster, api):
    identity = JobIdentity("d" * 200, "scheduled__2026-01-01T00:00:00+00:00", "train_" + "t" * 100, 12)
    spec = spec_for(api, {"namespace": NS_FULL}, resources={"nodes": 4096, "gpus_per_node": 8,
                                                           "processes_per_node": 8},
                    optimization={"global_batch_size": 8 * 4096 * 8})
    handle = cluster.backend(NS_FULL).submit(job_for(spec, identity))
    assert len(handle["name"]) <= 63 and cluster.get(api, NS_FULL, handle["name"]) is not None


@pytest.mark.parametrize("api,field,value,match", [
    # A value the TrainJob CRD's CEL rule on spec.managedBy refuses: HTTP 422.
    ("trainjob", "managedBy", "example.com/someone-else", r"HTTP 422 .*spec.managedBy"),
    # A field the PyTorchJob CRD does not have: strict field validation, HTTP 400.
    ("pytorchjob", "elasticPolicyX", {}, r"the installed PyTorchJob CRD \(v1\) has no field "
                                         r"spec.elasticPolicyX"),
])
def test_a_refused_job_is_permanent_and_leaves_nothing(cluster, api, field, value, match):
    class Refused(KubernetesBackend):
        def render(self, job):
            objects = super().render(job)
            objects["job"]["spec"][field] = value
            return objects

    backend = Refused(namespace=NS_DEMO, kubeconfig=str(cluster.server.kubeconfig), request_timeout_s=10)
    with pytest.raises(JobRefusedError, match=match):
        backend.submit(demo_job(api))
    assert cluster.get(api, NS_DEMO) is None and cluster.configmap(NS_DEMO) is None


# -- strict fields against older CRDs ----------------------------------------------------------
def test_an_older_trainer_crd_is_refused_naming_the_fields_and_the_release(cluster, kube_apiserver):
    backend = cluster.backend()
    with kube_apiserver.crd_swapped("trainer-v2.1.0_trainjobs.yaml"):
        with pytest.raises(JobRefusedError) as refused:
            backend.submit(demo_job("trainjob"))
        assert cluster.get("trainjob", NS_DEMO) is None and cluster.configmap(NS_DEMO) is None
    message = str(refused.value)
    assert "the installed TrainJob CRD (v1alpha1) has no field" in message
    assert "spec.runtimePatches" in message and "spec.activeDeadlineSeconds" in message
    assert "Kubeflow Trainer v2.2" in message


def test_trainer_2_2_holds_every_field_trainforge_sets(cluster, kube_apiserver):
    backend = cluster.backend(NS_FULL)
    with kube_apiserver.crd_swapped("trainer-v2.2.1_trainjobs.yaml"):
        job = full_job("trainjob")
        backend.submit(job)
        assert holds(cluster.get("trainjob", NS_FULL)["spec"], backend.render(job)["job"]["spec"])


# -- status ---------------------------------------------------------------------------------
def test_trainjob_status_transitions_from_conditions(cluster):
    backend = cluster.backend()
    handle = backend.submit(demo_job("trainjob"))
    status = backend.status(handle)
    assert status.state == JobState.PENDING and "no pods created yet" in status.message

    pod, labels = POD0["trainjob"], RANK0["trainjob"]
    cluster.pod(NS_DEMO, pod, labels, "Pending", "node", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}])
    status = backend.status(handle)
    assert status.state == JobState.PENDING
    assert "Unschedulable: 0/4 nodes are available" in status.message

    cluster.pod(NS_DEMO, pod, labels, "Running", "node",
                state={"running": {"startedAt": _rfc3339(time.time())}})
    assert backend.status(handle).state == JobState.RUNNING

    result = {"status": "success", "exit_code": 0, "message": "finished at step 300", "final_step": 300}
    cluster.pod(NS_DEMO, pod, labels, "Succeeded", "node",
                state={"terminated": {"exitCode": 0, "message": json.dumps(result)}})
    # The pod alone does not decide the outcome: without the Complete condition it still runs.
    assert backend.status(handle).state == JobState.RUNNING
    cluster.conditions("trainjob", NS_DEMO, DONE["trainjob"])
    status = backend.status(handle)
    assert (status.state, status.exit_code, status.result) == (JobState.SUCCEEDED, 0, result)
    assert status.wall_s is not None

    # ...and a job that completed is still succeeded after its pods are gone.
    cluster.core.delete_namespaced_pod(pod, NS_DEMO, grace_period_seconds=0)
    assert backend.status(handle).state == JobState.SUCCEEDED


@pytest.mark.parametrize("result,exit_code,kind", [
    ({"status": "bad_config", "exit_code": 78, "message": "dataset manifest missing"}, 1,
     FailureKind.PERMANENT),
    ({"status": "error", "exit_code": 1, "message": "RuntimeError: NCCL timeout"}, 1,
     FailureKind.TRANSIENT),
    (None, 137, FailureKind.TRANSIENT),
])
def test_pytorchjob_failure_kind_from_rank0_exit(cluster, result, exit_code, kind):
    backend = cluster.backend()
    handle = backend.submit(demo_job("pytorchjob"))
    cluster.conditions("pytorchjob", NS_DEMO, ("Created", "True", "Created", ""),
                       ("Running", "False", "", ""), ("Failed", "True", "PyTorchJobFailed", "job failed"))
    term = {"exitCode": exit_code, **({"message": json.dumps(result)} if result else {})}
    cluster.pod(NS_DEMO, POD0["pytorchjob"], RANK0["pytorchjob"], "Failed", "pytorch",
                state={"terminated": term})
    status = backend.status(handle)
    assert (status.state, status.failure, status.exit_code) == (JobState.FAILED, kind, exit_code)
    assert (result or {}).get("message", "PyTorchJobFailed") in status.message


@pytest.mark.parametrize("api", APIS)
def test_suspended_and_queued_then_admitted(cluster, api):
    backend = cluster.backend(NS_FULL)
    handle = backend.submit(full_job(api))
    suspended = (cluster.get(api, NS_FULL)["spec"].get("suspend")
                 or cluster.get(api, NS_FULL)["spec"]["runPolicy"].get("suspend"))
    assert suspended  # created suspended for Kueue
    cluster.conditions(api, NS_FULL, ("Suspended", "True", "Suspended", "suspended"))
    cluster.workload(NS_FULL, handle["uid"], [{
        "type": "QuotaReserved", "status": "False", "reason": "Pending",
        "message": "couldn't assign flavors to pod set node: insufficient quota for nvidia.com/gpu"}])
    status = backend.status(handle)
    assert status.state == JobState.PENDING
    assert "QuotaReserved=False (Pending): couldn't assign flavors" in status.message
    # Admitted: Kueue unsuspends, the controller makes pods, rank 0 runs.
    cluster.conditions(api, NS_FULL, ("Suspended", "False", "Resumed", "resumed"))
    cluster.pod(NS_FULL, POD0[api], RANK0[api], "Running", r.TRAINER_CONTAINER[api],
                state={"running": {}})
    assert backend.status(handle).state == JobState.RUNNING


def test_suspended_without_rights_on_kueue_workloads_still_reports_pending(cluster, kube_apiserver):
    rules = [rule for rule in documented_role() if "workloads" not in rule["resources"]]
    kubeconfig = kube_apiserver.service_account_kubeconfig(NS_FULL, "no-kueue", rules)
    backend = cluster.backend(NS_FULL, kubeconfig)
    handle = backend.submit(full_job("pytorchjob"))
    cluster.conditions("pytorchjob", NS_FULL, ("Suspended", "True", "Suspended", "suspended"))
    status = backend.status(handle)
    assert status.state == JobState.PENDING
    assert status.message == "suspended: waiting for Kueue to admit it from LocalQueue 'team-a'"


# -- failures before start ------------------------------------------------------------------
@pytest.mark.parametrize("api", APIS)
def test_startup_timeout_fails_deletes_and_stays_failed_while_deleted(cluster, api):
    backend = cluster.backend(NS_FULL)
    handle = backend.submit(full_job(api))
    cluster.conditions(api, NS_FULL, ("Suspended", "True", "Suspended", "suspended"))
    cluster.workload(NS_FULL, handle["uid"], [{
        "type": "QuotaReserved", "status": "False", "reason": "Pending",
        "message": "insufficient quota for nvidia.com/gpu in flavor h100"}])
    # The handle as a poll 901 s after the submission sees it.
    late = {**handle, "submitted_at_epoch_s": handle["submitted_at_epoch_s"] - 901,
            "startup_deadline_epoch_s": handle["startup_deadline_epoch_s"] - 901}
    status = backend.status(late)
    assert status.state == JobState.FAILED and status.failure == FailureKind.TRANSIENT
    assert "did not start within fault.startup_timeout (900 s)" in status.message
    assert "insufficient quota for nvidia.com/gpu" in status.message
    assert cluster.configmap(NS_FULL) is None

    # Foreground deletion waits for the garbage collector: the job is still there, being
    # deleted. The next poll, and a cancel, still say FAILED and why, not CANCELLED.
    obj = cluster.get(api, NS_FULL)
    assert obj["metadata"]["deletionTimestamp"] and ANN_FAILED in obj["metadata"]["annotations"]
    again = backend.status(late)
    assert (again.state, again.failure, again.message) == (JobState.FAILED, FailureKind.TRANSIENT,
                                                           status.message)
    assert backend.cancel(late, 1).state == JobState.FAILED
    cluster.collect_garbage(api, NS_FULL)
    assert cluster.get(api, NS_FULL) is None


@pytest.mark.parametrize("reason,permanent", [("ImagePullBackOff", False), ("InvalidImageName", True)])
def test_startup_timeout_with_image_errors(cluster, reason, permanent):
    backend = cluster.backend()
    handle = backend.submit(demo_job("pytorchjob"))
    cluster.conditions("pytorchjob", NS_DEMO, ("Created", "True", "PyTorchJobCreated", ""))
    cluster.pod(NS_DEMO, POD0["pytorchjob"], RANK0["pytorchjob"], "Pending", "pytorch",
                state={"waiting": {"reason": reason, "message": 'Back-off pulling image "x"'}})
    status = backend.status(handle)
    assert status.state == JobState.PENDING and reason in status.message
    status = backend.status({**handle, "startup_deadline_epoch_s": time.time() - 1})
    assert status.state == JobState.FAILED and reason in status.message
    assert status.failure == (FailureKind.PERMANENT if permanent else FailureKind.TRANSIENT)
    assert cluster.get("pytorchjob", NS_DEMO)["metadata"]["deletionTimestamp"]


def test_restarting_beyond_the_limit_fails_and_deletes(cluster):
    backend = cluster.backend(NS_FULL)
    handle = backend.submit(full_job("trainjob"))  # fault.max_restarts = 2
    labels = {**RANK0["trainjob"], "jobset.sigs.k8s.io/restart-attempt": "2"}
    cluster.pod(NS_FULL, POD0["trainjob"], labels, "Running", "node", state={"running": {}})
    # Another job's pod in the namespace does not count (the selector is the job's own).
    cluster.pod(NS_FULL, "other-node-0-0-a", {**labels, "jobset.sigs.k8s.io/jobset-name": "other",
                                              "jobset.sigs.k8s.io/restart-attempt": "9"},
                "Running", "node", state={"running": {}})
    assert backend.status(handle).state == JobState.RUNNING  # 2 restarts: allowed
    cluster.pod(NS_FULL, POD0["trainjob"], {**labels, "jobset.sigs.k8s.io/restart-attempt": "3"},
                "Running", "node", state={"running": {}})
    status = backend.status(handle)
    assert status.state == JobState.FAILED and status.failure == FailureKind.TRANSIENT
    assert "restarted 3 times, more than fault.max_restarts = 2" in status.message
    assert backend.status(handle).message == status.message  # while being deleted


# What the controllers say when they cannot make a job's pods (messages as the API words them).
JOBSET_REFUSED = (
    'TrainJob resources reconciliation failed: admission webhook "vjobset.kb.io" denied the '
    'request: spec.replicatedJobs[0]: Invalid value: "x-node-0-1-abcde": must be no more than '
    '63 characters')
POD_REFUSED = ('Error creating: Pod "x-worker-11" is invalid: metadata.name: Invalid value: '
               '"x-worker-11": must be no more than 63 characters')
QUOTA = ('Error creating: pods "x-master-0" is forbidden: exceeded quota: gpu-quota, requested: '
         'nvidia.com/gpu=8, used: nvidia.com/gpu=8, limited: nvidia.com/gpu=8')


@pytest.mark.parametrize("api,kind,name,reason,message", [
    ("trainjob", "TrainJob", NAME, "TrainJobResourcesCreationFailed", JOBSET_REFUSED),
    ("trainjob", "Job", f"{NAME}-node-0", "FailedCreate", POD_REFUSED),
    ("pytorchjob", "PyTorchJob", NAME, "FailedCreatePod", POD_REFUSED),
])
def test_a_job_whose_controller_cannot_make_pods_fails_permanently_with_its_reason(
        cluster, api, kind, name, reason, message):
    backend = cluster.backend()
    handle = backend.submit(demo_job(api))
    assert backend.status(handle).state == JobState.PENDING
    cluster.event(NS_DEMO, kind, name, reason, message)
    cluster.event(NS_DEMO, kind, "another-job", reason, "not this job's")
    status = backend.status(handle)  # long before fault.startup_timeout
    assert (status.state, status.failure) == (JobState.FAILED, FailureKind.PERMANENT)
    assert f"{kind} {name} {reason}: " in status.message
    assert "must be no more than 63 characters" in status.message
    assert cluster.get(api, NS_DEMO)["metadata"]["deletionTimestamp"]


def test_a_creation_failure_that_may_clear_up_is_the_pending_reason(cluster):
    backend = cluster.backend()
    handle = backend.submit(demo_job("pytorchjob"))
    cluster.event(NS_DEMO, "PyTorchJob", NAME, "FailedCreatePod", QUOTA)
    status = backend.status(handle)
    assert status.state == JobState.PENDING and "exceeded quota: gpu-quota" in status.message
    status = backend.status({**handle, "startup_deadline_epoch_s": time.time() - 1})
    assert (status.state, status.failure) == (JobState.FAILED, FailureKind.TRANSIENT)
    assert "exceeded quota: gpu-quota" in status.message


def test_a_trainjob_failed_because_its_objects_were_refused_is_permanent(cluster):
    backend = cluster.backend()
    handle = backend.submit(demo_job("trainjob"))
    cluster.conditions("trainjob", NS_DEMO, ("Failed", "True", "ResourcesCreationFailed", JOBSET_REFUSED))
    status = backend.status(handle)
    assert (status.state, status.failure) == (JobState.FAILED, FailureKind.PERMANENT)
    assert "must be no more than 63 characters" in status.message


# -- cancel ---------------------------------------------------------------------------------
@pytest.mark.parametrize("api", APIS)
def test_cancel_deletes_foreground_and_is_idempotent(cluster, api):
    backend = cluster.backend()
    handle = backend.submit(demo_job(api))
    status = backend.cancel(handle, 0.5)
    # No garbage collector: the job waits, being deleted, with no pods to force-delete.
    obj = cluster.get(api, NS_DEMO)
    assert obj["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert status.state == JobState.CANCELLED
    assert status.message == (f"{NAME} deletion requested; no pods left to force-delete after "
                              f"0 s; the cluster's garbage collector removes the job")
    assert cluster.configmap(NS_DEMO) is None
    assert backend.status(handle).state == JobState.CANCELLED  # being deleted reads as cancelled
    cluster.collect_garbage(api, NS_DEMO)
    assert backend.cancel(handle, 0.5).state == JobState.CANCELLED  # already gone is fine


def test_cancel_force_deletes_the_pods_it_finds_and_says_how_many(cluster):
    backend = cluster.backend()
    handle = backend.submit(demo_job("trainjob"))
    cluster.pod(NS_DEMO, POD0["trainjob"], RANK0["trainjob"], "Running", "node", state={"running": {}})
    cluster.pod(NS_DEMO, f"{NAME}-node-0-1-fghij", {**RANK0["trainjob"],
                "batch.kubernetes.io/job-completion-index": "1"}, "Running", "node", state={"running": {}})
    started = time.monotonic()
    status = backend.cancel(handle, 1.0)
    assert 1.0 <= time.monotonic() - started < 10
    assert status.state == JobState.CANCELLED
    assert status.message == f"{NAME} deletion requested; 2 pods force-deleted after 1 s"
    assert cluster.core.list_namespaced_pod(NS_DEMO).items == []


def test_cancel_leaves_a_finished_job_alone(cluster):
    backend = cluster.backend()
    handle = backend.submit(demo_job("trainjob"))
    cluster.conditions("trainjob", NS_DEMO, DONE["trainjob"])
    assert backend.cancel(handle, 1).state == JobState.SUCCEEDED
    assert not cluster.get("trainjob", NS_DEMO)["metadata"].get("deletionTimestamp")


# -- identities, RBAC and owner references ----------------------------------------------------
@pytest.mark.parametrize("api", APIS)
def test_the_documented_role_is_enough_under_owner_reference_enforcement(cluster, kube_apiserver, api):
    kubeconfig = kube_apiserver.service_account_kubeconfig(NS_FULL, "trainforge", documented_role())
    backend = cluster.backend(NS_FULL, kubeconfig)
    handle = backend.submit(full_job(api))
    assert cluster.configmap(NS_FULL)["metadata"]["owner_references"][0]["uid"] == handle["uid"]
    assert backend.status(handle).state == JobState.PENDING  # events, pods and Kueue readable
    cluster.pod(NS_FULL, POD0[api], RANK0[api], "Running", r.TRAINER_CONTAINER[api], state={"running": {}})
    assert backend.status(handle).state == JobState.RUNNING
    assert backend.cancel(handle, 0.3).message.endswith("1 pod force-deleted after 0 s")


def test_the_documented_role_records_why_it_deleted_a_failed_job(cluster, kube_apiserver):
    kubeconfig = kube_apiserver.service_account_kubeconfig(NS_FULL, "trainforge", documented_role())
    backend = cluster.backend(NS_FULL, kubeconfig)
    handle = backend.submit(full_job("pytorchjob"))
    late = {**handle, "startup_deadline_epoch_s": time.time() - 1}
    failed = backend.status(late)
    assert failed.state == JobState.FAILED
    assert backend.status(late) == failed  # while the garbage collector has not finished


@pytest.mark.parametrize("resource,verb,left", [
    ("trainjobs", "create", "nothing"),      # refused by the dry run, before anything exists
    ("configmaps", "patch", "nothing"),      # refused after the job exists: removed again
])
def test_a_role_missing_one_verb_is_refused_permanently_and_leaves_no_orphan(
        cluster, kube_apiserver, resource, verb, left):
    rules = [{**rule, "verbs": [v for v in rule["verbs"] if not (resource in rule["resources"] and v == verb)]}
             for rule in documented_role()]
    kubeconfig = kube_apiserver.service_account_kubeconfig(NS_FULL, f"no-{verb}", rules)
    backend = cluster.backend(NS_FULL, kubeconfig)
    with pytest.raises(JobRefusedError, match=rf"lacks {verb} on {resource} "):
        backend.submit(full_job("trainjob"))
    assert cluster.get("trainjob", NS_FULL) is None and cluster.configmap(NS_FULL) is None


def test_airflow_connection_with_inline_kubeconfig(cluster, kube_apiserver, monkeypatch):
    config = json.loads(kube_apiserver.kubeconfig.read_text())
    conn = {"conn_type": "kubernetes", "extra": {"kube_config": json.dumps(config),
                                                 "cluster_context": "envtest"}}
    monkeypatch.setenv("AIRFLOW_CONN_K8S_ENVTEST", json.dumps(conn))
    backend = KubernetesBackend(namespace=NS_DEMO, conn_id="k8s_envtest", request_timeout_s=10)
    assert backend.find(IDENTITY) is None
    assert backend.submit(demo_job("trainjob"))["name"] == NAME
