"""Kubernetes engine rendering: golden manifests, environment and Secret rules, the launcher.

Regenerate the goldens with ``TRAINFORGE_UPDATE_GOLDEN=1 pytest tests/operators/engines/kubernetes -k
kubernetes_render`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from trainforge.engines.kubernetes.render import LAUNCH_SCRIPT, RESULT_FILE, render_objects
from trainforge.engines.kubernetes.backend import KubernetesBackend
from tests.operators.engines.kubernetes.test_kubernetes_common import ENV, demo_job, full_job

GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = {
    "demo_trainjob": lambda: demo_job("trainjob"),
    "demo_pytorchjob": lambda: demo_job("pytorchjob"),
    "full_trainjob": lambda: full_job("trainjob"),
    "full_pytorchjob": lambda: full_job("pytorchjob"),
}


def _namespace(job) -> str:
    return job.engine_options["namespace"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_kubernetes_render_matches_golden(case):
    job = CASES[case]()
    rendered = KubernetesBackend(namespace=_namespace(job)).render(job)
    golden = GOLDEN / f"{case}.kubernetes.json"
    if os.environ.get("TRAINFORGE_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(rendered, indent=2, sort_keys=True) + "\n")
    assert rendered == json.loads(golden.read_text())


def test_render_is_pure_and_deterministic():
    job = full_job("trainjob")
    assert render_objects(job, "ml-train") == render_objects(job, "ml-train")


def _container_env(rendered):
    job = rendered["job"]
    if job["kind"] == "TrainJob":
        return job["spec"]["trainer"]["env"]
    return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_secrets_only_by_reference_and_mlflow_env(api):
    rendered = render_objects(full_job(api), "ml-train")
    env = {e["name"]: e for e in _container_env(rendered)}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name]
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "s3-credentials"
    assert env["MLFLOW_TRACKING_URI"]["value"] == ENV["MLFLOW_TRACKING_URI"]
    assert env["MLFLOW_RUN_ID"]["value"] == ENV["MLFLOW_RUN_ID"]
    assert env["OMP_NUM_THREADS"]["value"] == "4"
    # No Secret value and no secret name appears anywhere as a plain value.
    plain = [e.get("value", "") for e in env.values()]
    assert not any("secret" in v for v in plain)


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_kueue_suspended_and_queue_label(api):
    job = render_objects(full_job(api), "ml-train")["job"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    suspend = job["spec"]["suspend"] if api == "trainjob" else job["spec"]["runPolicy"]["suspend"]
    assert suspend is True
    demo = render_objects(demo_job(api), "default")["job"]
    assert "kueue.x-k8s.io/queue-name" not in demo["metadata"]["labels"]


def test_pytorchjob_replicas_restarts_and_deadline():
    job = render_objects(full_job("pytorchjob"), "ml-train")["job"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    assert job["spec"]["runPolicy"]["backoffLimit"] == 2
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == 3600
    container = specs["Master"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["resources"]["requests"]["memory"] == "640Gi"
    assert specs["Master"]["template"]["spec"]["priorityClassName"] == "high"
    single = render_objects(demo_job("pytorchjob"), "default")["job"]["spec"]["pytorchReplicaSpecs"]
    assert list(single) == ["Master"]


def test_secret_env_may_not_shadow_a_plain_variable():
    job = full_job("trainjob")
    job = dataclasses.replace(job, env={**job.env, "AWS_ACCESS_KEY_ID": "AKIA..."})
    with pytest.raises(ValueError, match="AWS_ACCESS_KEY_ID.*plain value"):
        render_objects(job, "ml-train")


def test_render_needs_an_image():
    job = dataclasses.replace(demo_job(), image=None)
    with pytest.raises(ValueError, match="resources.image"):
        render_objects(job, "default")


def _launch(tmp_path, child: str) -> tuple[int, str]:
    """Run the launcher with a fake torchrun (a shell snippet) as its child."""
    term = tmp_path / "termination-log"
    env = {**os.environ, "TRAINFORGE_RESULT_FILE": str(tmp_path / "result.json"),
           "TRAINFORGE_TERMINATION_LOG": str(term)}
    proc = subprocess.run(["/bin/sh", "-c", LAUNCH_SCRIPT, "trainforge-launch", "/bin/sh", "-c", child],
                          env=env, timeout=30)
    return proc.returncode, term.read_text() if term.exists() else ""


def test_launcher_passes_exit_code_and_result_to_the_termination_message(tmp_path):
    result = '{"status": "bad_config", "exit_code": 78, "message": "no dataset"}'
    code, message = _launch(tmp_path, f"echo '{result}' > \"$TRAINFORGE_RESULT_FILE\"; exit 1")
    assert code == 1
    assert json.loads(message)["status"] == "bad_config"
    clean = tmp_path / "clean"
    clean.mkdir()
    assert _launch(clean, "exit 0") == (0, "")  # no result file: no termination message


def test_launcher_forwards_sigterm_to_torchrun(tmp_path):
    term = tmp_path / "termination-log"
    marker = tmp_path / "got-term"
    child = (f"trap 'echo term > {marker}; echo {{\\\"status\\\": \\\"error\\\"}} > "
             f"\"$TRAINFORGE_RESULT_FILE\"; exit 143' TERM; while :; do sleep 0.1; done")
    env = {**os.environ, "TRAINFORGE_RESULT_FILE": str(tmp_path / "result.json"),
           "TRAINFORGE_TERMINATION_LOG": str(term)}
    proc = subprocess.Popen(["/bin/sh", "-c", LAUNCH_SCRIPT, "trainforge-launch", "/bin/sh", "-c", child],
                            env=env)
    import time

    time.sleep(0.5)
    proc.terminate()
    assert proc.wait(timeout=30) == 143
    assert marker.read_text().strip() == "term"
    assert json.loads(term.read_text()) == {"status": "error"}


def test_result_file_is_under_the_run_volume():
    job = render_objects(demo_job("trainjob"), "default")["job"]
    env = {e["name"]: e.get("value") for e in job["spec"]["trainer"]["env"]}
    assert env["TRAINFORGE_RESULT_FILE"] == RESULT_FILE
    mounts = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert any(RESULT_FILE.startswith(m["mountPath"] + "/") for m in mounts)


def test_trainjob_priority_needs_a_kueue_queue():
    from pydantic import ValidationError

    from tests.operators.engines.kubernetes.test_kubernetes_common import spec_for

    with pytest.raises(ValidationError, match="priority_class 'high' with api 'trainjob'.*needs queue_name"):
        spec_for("trainjob", {"priority_class": "high"})
    assert spec_for("pytorchjob", {"priority_class": "high"}).training.kubernetes.priority_class == "high"


@pytest.mark.parametrize("secret_env,message", [
    ([{"name": "MLFLOW_RUN_ID", "secret": "s", "key": "k"}], "may not set MLFLOW_RUN_ID"),
    ([{"name": "A", "secret": "s", "key": "k"}, {"name": "A", "secret": "t", "key": "k"}],
     "names A more than once"),
])
def test_secret_env_names_are_checked_by_the_spec(secret_env, message):
    from pydantic import ValidationError

    from tests.operators.engines.kubernetes.test_kubernetes_common import spec_for

    with pytest.raises(ValidationError, match=message):
        spec_for("trainjob", {"secret_env": secret_env})
