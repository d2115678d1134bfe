"""Pure rendering of the Kubernetes engine's objects: the ConfigMap and the job (their names and
labels: :mod:`trainforge.engines.kubernetes.names`).

Two custom resources, chosen by ``training.kubernetes.api``:

* ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``, Kubeflow Trainer 2.3): ``spec.runtimeRef``
  names a ClusterTrainingRuntime (``torch-distributed``); ``spec.trainer`` carries the image,
  command, nodes, processes per node, resources and environment; pod-level settings (volumes,
  tolerations, node selector, security context, service account) go into one
  ``spec.runtimePatches`` entry owned by the manager :data:`PATCH_MANAGER`, patching the
  runtime's ``node`` replicated job and its ``node`` container.
* ``PyTorchJob`` (``kubeflow.org/v1``, Kubeflow training operator 1.9): a ``Master`` replica and
  ``nodes - 1`` ``Worker`` replicas with full pod templates (container ``pytorch``).

Both run the same launcher: ``torchrun ... -m trainforge.trainer.train --config /etc/trainforge/job.json``
wrapped in a short POSIX shell script (:data:`LAUNCH_SCRIPT`) that forwards SIGTERM to torchrun and
copies rank 0's result file (docs/contracts.md) into the container's termination message, so the
backend can tell a permanent failure (exit 78/79) from a transient one although torchrun itself
exits 1 whenever a worker fails.

Nothing here does I/O; :func:`render_objects` is what ``trainforge render`` prints and what the
backend submits.
"""

from __future__ import annotations

import json
from typing import Any

from trainforge.engines.base import TrainingJob
from trainforge.engines.kubernetes.names import (
    MAX_POD_INDEX,
    LABEL_PREFIX,
    TRAINJOB_REPLICATED_JOB,
    configmap_name,
    identity_annotations,
    identity_labels,
    resource_name,
)
from trainforge.engines.launch import rank_env, torchrun_argv

TRAINJOB_GROUP, TRAINJOB_VERSION, TRAINJOB_PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, PYTORCHJOB_PLURAL = "kubeflow.org", "v1", "pytorchjobs"
APIS = {
    # api name -> (group, version, plural, kind)
    "trainjob": (TRAINJOB_GROUP, TRAINJOB_VERSION, TRAINJOB_PLURAL, "TrainJob"),
    "pytorchjob": (PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, PYTORCHJOB_PLURAL, "PyTorchJob"),
}

# The container that runs torchrun: the torch-distributed runtime names its trainer container
# "node"; the training operator requires "pytorch".
TRAINER_CONTAINER = {"trainjob": "node", "pytorchjob": "pytorch"}
# Owner of the runtimePatches entry (the API keys patches by a domain-prefixed manager name).
PATCH_MANAGER = "trainforge.io/trainforge"

ANN_STARTUP_TIMEOUT = LABEL_PREFIX + "startup-timeout-s"
ANN_MAX_RESTARTS = LABEL_PREFIX + "max-restarts"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"

CONFIG_DIR = "/etc/trainforge"
CONFIG_FILE = "job.json"
RUN_DIR = "/var/run/trainforge"
RESULT_FILE = f"{RUN_DIR}/result.json"

# Runs as `sh -c LAUNCH_SCRIPT trainforge-launch torchrun ARGS...`. torchrun runs as a child so
# that SIGTERM (pod deletion) reaches it (a shell as PID 1 would not pass it on); when it ends,
# rank 0's result file becomes the termination message (kubelet keeps at most 4096 bytes of it
# in containerStatuses[].state.terminated.message) and the script exits with torchrun's code.
LAUNCH_SCRIPT = """\
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
wait "$child"
rc=$?
while kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done
if [ -s "$TRAINFORGE_RESULT_FILE" ]; then
  cat "$TRAINFORGE_RESULT_FILE" > "${TRAINFORGE_TERMINATION_LOG:-/dev/termination-log}" || true
fi
exit "$rc"
"""

def _quantity(gib: float) -> str:
    """A memory quantity: whole GiB as ``Gi``, otherwise whole MiB (rounded)."""
    mib = int(round(gib * 1024))
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def _options(job: TrainingJob) -> dict[str, Any]:
    """The kubernetes block with defaults filled in (``engine_options`` is its JSON dump)."""
    from trainforge.engines.kubernetes.spec import KubernetesEngine

    return KubernetesEngine.model_validate(job.engine_options).model_dump(mode="json")


def _command(job: TrainingJob, api: str) -> list[str]:
    # PyTorchJob: the training operator restarts failed pods (runPolicy.backoffLimit), so
    # torchrun does not restart in place. TrainJob: JobSet restarts come from the runtime's
    # failure policy; torchrun restarts the local group in place up to fault.max_restarts.
    restarts = 0 if api == "pytorchjob" else job.max_restarts
    return ["/bin/sh", "-c", LAUNCH_SCRIPT, "trainforge-launch",
            *torchrun_argv(job, f"{CONFIG_DIR}/{CONFIG_FILE}", standalone=False, nnodes="",
                           max_restarts=restarts)]


def _env(job: TrainingJob, opts: dict[str, Any]) -> list[dict[str, Any]]:
    secret_names = {item["name"] for item in opts["secret_env"]}
    plain = {
        **rank_env(job, RESULT_FILE),
        **job.env,
    }
    clash = sorted(secret_names & set(plain))
    if clash:
        raise ValueError(
            f"training.kubernetes.secret_env names {', '.join(clash)}, which the job already sets "
            f"as a plain value; expected each variable from one source only"
        )
    env = [{"name": k, "value": str(v)} for k, v in sorted(plain.items())]
    env += [
        {"name": item["name"], "valueFrom": {"secretKeyRef": {"name": item["secret"], "key": item["key"]}}}
        for item in opts["secret_env"]
    ]
    return env


def _resources(job: TrainingJob) -> dict[str, Any]:
    cpu = str(job.processes_per_node * job.threads_per_process)
    requests: dict[str, str] = {"cpu": cpu}
    limits: dict[str, str] = {"cpu": cpu}
    if job.memory_gib is not None:
        requests["memory"] = limits["memory"] = _quantity(job.memory_gib)
    if job.gpus_per_node:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(job.gpus_per_node)
    return {"requests": requests, "limits": limits}


def _volumes(name: str, opts: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": "job-config", "configMap": {"name": configmap_name(name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _quantity(opts["shm_size_gib"])}},
        {"name": "trainforge-run", "emptyDir": {}},
    ]


def _volume_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "job-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "trainforge-run", "mountPath": RUN_DIR},
    ]


def _pod_security(opts: dict[str, Any]) -> dict[str, Any]:
    uid = opts["run_as_user"]
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security(opts: dict[str, Any]) -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": opts["run_as_user"],
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _tolerations(opts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in t.items() if v is not None} for t in opts["tolerations"]]


def _pod_spec_extras(opts: dict[str, Any]) -> dict[str, Any]:
    """Scheduling and identity fields of the pod spec that the spec may set."""
    extras: dict[str, Any] = {}
    if opts["service_account"]:
        extras["serviceAccountName"] = opts["service_account"]
    if opts["node_selector"]:
        extras["nodeSelector"] = dict(sorted(opts["node_selector"].items()))
    if opts["tolerations"]:
        extras["tolerations"] = _tolerations(opts)
    if opts["image_pull_secrets"]:
        extras["imagePullSecrets"] = [{"name": s} for s in opts["image_pull_secrets"]]
    return extras


def _metadata(job: TrainingJob, name: str, namespace: str, opts: dict[str, Any], api: str) -> dict[str, Any]:
    labels = identity_labels(job.identity, api)
    if opts["queue_name"]:
        labels[KUEUE_QUEUE_LABEL] = opts["queue_name"]
        if opts["priority_class"] and api == "trainjob":
            # TrainJob cannot set the pods' priorityClassName; Kueue reads the workload's
            # priority from this label (a WorkloadPriorityClass of that name).
            labels[KUEUE_PRIORITY_LABEL] = opts["priority_class"]
    annotations = identity_annotations(job.identity)
    if job.startup_timeout_s is not None:
        annotations[ANN_STARTUP_TIMEOUT] = str(int(job.startup_timeout_s))
    annotations[ANN_MAX_RESTARTS] = str(job.max_restarts)
    return {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations}


def render_configmap(job: TrainingJob, name: str, namespace: str,
                     api: str = "trainjob") -> dict[str, Any]:
    """The ConfigMap with the trainer's ``job.json`` (core/v1)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": configmap_name(name), "namespace": namespace,
                     "labels": identity_labels(job.identity, api),
                     "annotations": identity_annotations(job.identity)},
        "data": {CONFIG_FILE: json.dumps(job.config, indent=2, sort_keys=True) + "\n"},
    }


def render_trainjob(job: TrainingJob, name: str, namespace: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The Kubeflow Trainer ``TrainJob`` (trainer.kubeflow.org/v1alpha1)."""
    pod_spec: dict[str, Any] = {
        **_pod_spec_extras(opts),
        "securityContext": _pod_security(opts),
        "volumes": _volumes(name, opts),
        "containers": [{"name": TRAINER_CONTAINER["trainjob"], "volumeMounts": _volume_mounts(),
                        "securityContext": _container_security(opts)}],
    }
    spec: dict[str, Any] = {
        "runtimeRef": {"apiGroup": TRAINJOB_GROUP, "kind": "ClusterTrainingRuntime",
                       "name": opts["runtime"]},
        "trainer": {
            "image": job.image,
            "command": _command(job, "trainjob"),
            "numNodes": job.nodes,
            "numProcPerNode": job.processes_per_node,
            "resourcesPerNode": _resources(job),
            "env": _env(job, opts),
        },
        "runtimePatches": [{
            "manager": PATCH_MANAGER,
            "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                "name": TRAINJOB_REPLICATED_JOB,
                "template": {"spec": {"template": {
                    "metadata": {"labels": identity_labels(job.identity, "trainjob")},
                    "spec": pod_spec,
                }}},
            }]}}},
        }],
    }
    if opts["queue_name"]:
        spec["suspend"] = True
    if job.max_runtime_s:
        spec["activeDeadlineSeconds"] = int(job.max_runtime_s)
    return {
        "apiVersion": f"{TRAINJOB_GROUP}/{TRAINJOB_VERSION}",
        "kind": "TrainJob",
        "metadata": _metadata(job, name, namespace, opts, "trainjob"),
        "spec": spec,
    }


def pod_template(job: TrainingJob, name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The PyTorchJob replicas' pod template (core/v1 PodTemplateSpec)."""
    spec: dict[str, Any] = {
        **_pod_spec_extras(opts),
        "securityContext": _pod_security(opts),
        "containers": [{
            "name": TRAINER_CONTAINER["pytorchjob"],
            "image": job.image,
            "command": _command(job, "pytorchjob"),
            "env": _env(job, opts),
            "resources": _resources(job),
            "volumeMounts": _volume_mounts(),
            "securityContext": _container_security(opts),
        }],
        "volumes": _volumes(name, opts),
    }
    if opts["priority_class"]:
        spec["priorityClassName"] = opts["priority_class"]
    return {"metadata": {"labels": identity_labels(job.identity, "pytorchjob")}, "spec": spec}


def render_pytorchjob(job: TrainingJob, name: str, namespace: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The training operator's ``PyTorchJob`` (kubeflow.org/v1)."""
    template = pod_template(job, name, opts)
    replicas: dict[str, Any] = {
        "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template},
    }
    if job.nodes > 1:
        replicas["Worker"] = {"replicas": job.nodes - 1, "restartPolicy": "OnFailure",
                              "template": template}
    run_policy: dict[str, Any] = {
        # Pods still running when the job ends are deleted (they hold GPUs); finished pods stay
        # so that rank 0's log and exit code can still be read.
        "cleanPodPolicy": "Running",
        "backoffLimit": job.max_restarts,
    }
    if job.max_runtime_s:
        run_policy["activeDeadlineSeconds"] = int(job.max_runtime_s)
    if opts["queue_name"]:
        run_policy["suspend"] = True
    return {
        "apiVersion": f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}",
        "kind": "PyTorchJob",
        "metadata": _metadata(job, name, namespace, opts, "pytorchjob"),
        "spec": {
            "nprocPerNode": str(job.processes_per_node),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": replicas,
        },
    }


def render_objects(job: TrainingJob, namespace: str) -> dict[str, Any]:
    """``{"engine", "api", "namespace", "configmap", "job"}``: the exact objects submitted.

    Raises:
        ValueError: the job cannot run on Kubernetes (no image, a variable set twice, more
            nodes than the names are budgeted for).
    """
    if not job.image:
        raise ValueError("the kubernetes engine needs resources.image, the trainer's container "
                         "image (got none)")
    if job.nodes > int(MAX_POD_INDEX) + 1:
        raise ValueError(f"the kubernetes engine names pods for at most {int(MAX_POD_INDEX) + 1} "
                         f"nodes (got resources.nodes {job.nodes})")
    opts = _options(job)
    api = opts["api"]
    name = resource_name(job.identity, api)
    render = render_trainjob if api == "trainjob" else render_pytorchjob
    return {
        "engine": "kubernetes",
        "api": api,
        "namespace": namespace,
        "configmap": render_configmap(job, name, namespace, api),
        "job": render(job, name, namespace, opts),
    }
