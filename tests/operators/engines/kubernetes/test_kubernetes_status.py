"""The Kubernetes status tables and readers (pure: plain API JSON in, neutral state out)."""

from __future__ import annotations

import json

import pytest

from trainforge.engines.kubernetes import status as s
from trainforge.engines.base import JobState
from trainforge.engines.kubernetes.client import connection_settings
from trainforge.errors import BackendError


def _job(*conds):
    return {"status": {"conditions": [{"type": t, "status": st} for t, st in conds]}}


@pytest.mark.parametrize("api,conds,state", [
    ("trainjob", [], None),
    ("trainjob", [("Suspended", "True")], JobState.PENDING),
    ("trainjob", [("Suspended", "False"), ("Complete", "True")], JobState.SUCCEEDED),
    ("trainjob", [("Complete", "False"), ("Failed", "True")], JobState.FAILED),
    ("pytorchjob", [("Created", "True")], JobState.PENDING),
    ("pytorchjob", [("Created", "True"), ("Running", "True")], JobState.RUNNING),
    ("pytorchjob", [("Created", "True"), ("Running", "False"), ("Restarting", "True")], JobState.RUNNING),
    ("pytorchjob", [("Created", "True"), ("Running", "False"), ("Succeeded", "True")], JobState.SUCCEEDED),
    ("pytorchjob", [("Running", "False"), ("Failed", "True")], JobState.FAILED),
    ("pytorchjob", [("Created", "True"), ("Suspended", "True")], JobState.PENDING),
])
def test_condition_tables(api, conds, state):
    assert s.job_state(api, _job(*conds))[0] == state


def test_rank0_termination_reads_last_state_after_an_in_place_restart():
    pod = {"status": {"containerStatuses": [{"name": "pytorch", "state": {"waiting": {}},
                                             "lastState": {"terminated": {"exitCode": 79,
                                                                          "message": "not json"}}}]}}
    assert s.rank0_termination(pod, "pytorch") == (79, None)
    assert s.rank0_termination(pod, "node") == (None, None)


def test_workload_reason():
    admitted = {"metadata": {"name": "w"}, "status": {"conditions": [
        {"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"}]}}
    assert s.workload_reason(admitted) is None
    fresh = {"metadata": {"name": "w"}, "status": {}}
    assert "waiting in its queue" in s.workload_reason(fresh)


def test_pod_restarts_counts_jobset_attempts_and_container_restarts():
    pod = {"metadata": {"labels": {"jobset.sigs.k8s.io/restart-attempt": "2"}},
           "status": {"containerStatuses": [{"restartCount": 1}]}}
    assert s.pod_restarts(pod) == 3


def test_connection_extras_with_and_without_prefix(monkeypatch):
    kubeconfig = {"apiVersion": "v1", "kind": "Config", "clusters": [], "users": [], "contexts": []}
    monkeypatch.setenv("AIRFLOW_CONN_K8S_A", json.dumps({"conn_type": "kubernetes", "extra": {
        "extra__kubernetes__kube_config": json.dumps(kubeconfig),
        "extra__kubernetes__cluster_context": "prod", "disable_verify_ssl": "true"}}))
    settings = connection_settings("k8s_a")
    assert settings["kubeconfig_dict"] == kubeconfig and settings["context"] == "prod"
    assert settings["verify_ssl"] is False and settings["in_cluster"] is False
    monkeypatch.setenv("AIRFLOW_CONN_K8S_B", json.dumps({"conn_type": "kubernetes", "extra": {
        "kube_config": "clusters: [oops"}}))
    with pytest.raises(BackendError, match="'k8s_b'.*neither JSON nor YAML"):
        connection_settings("k8s_b")
    with pytest.raises(BackendError, match="'k8s_missing' for the kubernetes engine could not be read"):
        connection_settings("k8s_missing")


def test_importing_the_engine_does_not_import_the_kubernetes_client():
    import subprocess
    import sys

    code = ("import sys, trainforge.engines.kubernetes.backend as k; "
            "k.KubernetesBackend(namespace='x'); "
            "print('kubernetes' in sys.modules, 'kubernetes.client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    assert out == ["False", "False"]
