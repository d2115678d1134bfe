"""Engine blocks of ``training``: one block per cluster engine, used when ``training.engine``
names it.

``local`` runs torchrun on the Airflow worker's machine; ``kubernetes`` submits a Kubeflow
``TrainJob`` (trainer.kubeflow.org/v1alpha1) or a ``PyTorchJob`` (kubeflow.org/v1), optionally
queued by Kueue; ``ray`` submits a Ray job (``ray.job_submission``) whose entrypoint is torchrun;
``slurm`` submits an ``sbatch`` script that runs torchrun on every allocated node through ``srun``.

Where to connect (connection id, kubeconfig, namespace, address) lives here; how big the job is
lives in ``training.resources``, shared by every engine.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainforge.pipeline.base import SpecModel

# RFC 1123 label (namespaces, queue names, secret names, priority classes).
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# RFC 1123 subdomain (ConfigMap and Secret names may contain dots).
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Environment every rank gets from the engine and the train task (docs/contracts.md).
_ENGINE_ENV = frozenset({"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TRAINFORGE_RESULT_FILE",
                         "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"})


# Names of variables that hold credentials. The spec is committed and rendered verbatim into
# job requests, so credentials never come from it (README: "Credentials").
_CREDENTIAL_NAMES = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})
_CREDENTIAL_WORDS = frozenset({"PASSWORD", "PASSWD", "PASSPHRASE", "SECRET", "TOKEN",
                               "CREDENTIAL", "CREDENTIALS", "APIKEY"})


def is_credential_name(name: str) -> bool:
    """Whether an environment variable named ``name`` carries a credential: the AWS key
    variables, a ``_``-separated word such as PASSWORD, SECRET or TOKEN (``HF_TOKEN``, not
    ``TOKENIZERS_PARALLELISM``), or a name ending in ``_KEY`` or ``_KEY_ID`` (``WANDB_API_KEY``)."""
    upper = name.upper()
    words = upper.split("_")
    return (upper in _CREDENTIAL_NAMES or any(w in _CREDENTIAL_WORDS for w in words)
            or words[-1] == "KEY" or upper.endswith("_KEY_ID"))


def _check_env_vars(value: dict[str, str], engine: str, remedy: str,
                    engine_env: frozenset = frozenset()) -> dict[str, str]:
    """The checks every engine's ``env_vars`` gets (names, no credentials, none of
    ``engine_env``); raises ValueError naming the first bad name."""
    for name in value:
        if not _ENV_NAME.match(name):
            raise ValueError(f"not an environment variable name (got {name!r}; expected letters, "
                             f"digits and '_', not starting with a digit)")
        if name in engine_env:
            raise ValueError(f"env_vars may not set {name}: the engine sets it (expected "
                             f"names other than {', '.join(sorted(engine_env))})")
        if is_credential_name(name):
            raise ValueError(f"env_vars may not carry credentials: the spec is rendered verbatim "
                             f"into the {engine} job (got {name}; expected no secret in the spec: "
                             f"{remedy})")
    return value


def _dns(value: str, what: str, pattern: re.Pattern = _DNS_LABEL) -> str:
    if not pattern.match(value):
        raise ValueError(
            f"{what} must be a lowercase DNS name: letters a-z, digits and '-', starting and "
            f"ending with a letter or digit, at most 63 characters (got {value!r})"
        )
    return value


class LocalEngine(SpecModel):
    distributed_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend; auto = nccl with GPUs, gloo on CPU."
    )


class Toleration(SpecModel):
    """A Kubernetes pod toleration (core/v1 Toleration)."""

    key: str | None = Field(None, description="Taint key; empty with operator Exists matches all.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="How key and value match.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect matched; empty matches all effects."
    )


class SecretEnv(SpecModel):
    """An environment variable of every rank read from a Kubernetes Secret (never inline)."""

    name: str = Field(description="Environment variable name, e.g. AWS_ACCESS_KEY_ID.")
    secret: str = Field(description="Secret name in the job's namespace.")
    key: str = Field(description="Key inside the Secret.")

    @field_validator("name")
    @classmethod
    def _env_name(cls, value: str) -> str:
        if not _ENV_NAME.match(value):
            raise ValueError(f"not an environment variable name (got {value!r}; expected "
                             f"letters, digits and '_', not starting with a digit)")
        return value

    @field_validator("secret")
    @classmethod
    def _secret_name(cls, value: str) -> str:
        return _dns(value, "secret", _DNS_SUBDOMAIN)


class KubernetesEngine(SpecModel):
    """Kubeflow training on Kubernetes. The cluster needs Kubeflow Trainer (``TrainJob``) or the
    Kubeflow training operator (``PyTorchJob``), and Kueue when ``queue_name`` is set."""

    api: Literal["trainjob", "pytorchjob"] = Field(
        "trainjob", description="Custom resource to submit: Kubeflow Trainer's TrainJob "
        "(trainer.kubeflow.org/v1alpha1) or the training operator's PyTorchJob (kubeflow.org/v1)."
    )
    connection_id: str | None = Field(
        None, description="Airflow connection (Kubernetes provider type) holding the cluster "
        "credentials; default: the kubeconfig below, or in-cluster configuration."
    )
    kubeconfig: str | None = Field(None, description="Path of a kubeconfig file.")
    context: str | None = Field(None, description="kubeconfig context; default its current one.")
    namespace: str = Field("default", description="Namespace of the job and its ConfigMap.")
    runtime: str = Field(
        "torch-distributed", description="TrainJob only: the ClusterTrainingRuntime referenced."
    )
    queue_name: str | None = Field(
        None, description="Kueue LocalQueue; the job is created suspended and Kueue admits the "
        "whole gang at once."
    )
    priority_class: str | None = Field(
        None, description="Priority: PyTorchJob sets the pods' PriorityClass; TrainJob (whose "
        "pods take it from the runtime) labels the job kueue.x-k8s.io/priority-class, a Kueue "
        "WorkloadPriorityClass, and needs queue_name."
    )
    service_account: str | None = Field(None, description="ServiceAccount of the pods.")
    node_selector: dict[str, str] = Field({}, description="Node labels the pods must match.")
    tolerations: list[Toleration] = Field([], description="Taints the pods tolerate.")
    shm_size_gib: float = Field(
        2.0, gt=0, le=1024, description="Size of the memory-backed /dev/shm (data loader "
        "workers), GiB."
    )
    secret_env: list[SecretEnv] = Field(
        [], description="Environment of every rank read from Secrets (S3, registry credentials)."
    )
    image_pull_secrets: list[str] = Field([], description="Secrets for pulling the image.")
    run_as_user: int = Field(1000, ge=1, description="Non-root UID of the trainer containers.")

    @field_validator("namespace", "queue_name", "priority_class", "service_account", "runtime")
    @classmethod
    def _dns_fields(cls, value: str | None, info) -> str | None:
        return None if value is None else _dns(value, info.field_name)

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: list[str]) -> list[str]:
        return [_dns(v, "image_pull_secrets", _DNS_SUBDOMAIN) for v in value]

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, value: list[SecretEnv]) -> list[SecretEnv]:
        names = [item.name for item in value]
        for name in names:
            if name in _ENGINE_ENV:
                raise ValueError(f"secret_env may not set {name}: the engine sets it (expected "
                                 f"names other than {', '.join(sorted(_ENGINE_ENV))})")
            if names.count(name) > 1:
                raise ValueError(f"secret_env names {name} more than once (expected each "
                                 f"variable once)")
        return value

    @model_validator(mode="after")
    def _trainjob_priority(self) -> KubernetesEngine:
        if self.api == "trainjob" and self.priority_class and not self.queue_name:
            raise ValueError(
                f"priority_class {self.priority_class!r} with api 'trainjob' is a Kueue "
                f"WorkloadPriorityClass and needs queue_name (got none); set queue_name, or use "
                f"api 'pytorchjob' for a pod PriorityClass"
            )
        return self


class RayEngine(SpecModel):
    """A Ray cluster's job API. The cluster needs Ray (a RayCluster from KubeRay, or ``ray start
    --head``) with the trainforge packages importable, or a ``working_dir`` to upload."""

    address: str = Field(
        "http://127.0.0.1:8265", description="Ray dashboard address (job submission API)."
    )
    connection_id: str | None = Field(
        None, description="Airflow connection whose host (and port) is the dashboard address; "
        "overrides address."
    )
    working_dir: str | None = Field(
        None, description="Local folder uploaded as the job's runtime_env working_dir; default: "
        "none (the cluster already has trainforge installed)."
    )
    pip: list[str] = Field([], description="Extra pip requirements of the job's runtime_env.")
    env_vars: dict[str, str] = Field(
        {}, description="Extra environment of the job. No credentials: names such as "
        "AWS_SECRET_ACCESS_KEY, HF_TOKEN, *_PASSWORD or *_API_KEY are refused (S3 access comes "
        "from storage.aws_conn_id)."
    )
    entrypoint_num_cpus: float = Field(
        0.0, ge=0, description="CPUs reserved for the entrypoint; default: the job's ranks x "
        "resources.cpus_per_process."
    )
    entrypoint_num_gpus: float = Field(
        0.0, ge=0, description="GPUs reserved for the entrypoint; default: "
        "resources.gpus_per_node."
    )

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if not re.match(r"^(https?|ray)://[^/\s]+", value):
            raise ValueError(f"not a Ray address (got {value!r}; expected e.g. "
                             f"'http://127.0.0.1:8265')")
        return value.rstrip("/")

    @field_validator("env_vars")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env_vars(value, "Ray", "S3 credentials come from storage.aws_conn_id, "
                               "others from the Ray cluster's own environment or secrets")


# Slurm names (partitions, accounts, QOS, reservations, GPU types): no spaces, quotes or shell
# characters, so they go into #SBATCH lines verbatim.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# A node feature expression of --constraint: features joined by & | , with [ ] ( ) * and counts.
_SLURM_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.\-&|,\[\]()*]{1,256}$")


class SlurmEngine(SpecModel):
    """A Slurm cluster through its command-line tools (``sbatch``, ``squeue``, ``sacct``,
    ``scancel``) on the Airflow worker, which must be a Slurm submit (login) node. The cluster
    needs Slurm >= 22.05, a file system shared by that node and the compute nodes for the job
    folders, and trainforge with torch in the nodes' Python (docs/slurm.md)."""

    partition: str | None = Field(None, description="sbatch --partition; default: the "
                                  "cluster's default partition.")
    account: str | None = Field(None, description="sbatch --account charged for the job.")
    qos: str | None = Field(None, description="sbatch --qos (quality of service).")
    reservation: str | None = Field(None, description="sbatch --reservation to run in.")
    constraint: str | None = Field(
        None, description="sbatch --constraint: node features the nodes must have, e.g. "
        "'a100&ib' or '[rack1|rack2]'."
    )
    gpu_type: str | None = Field(
        None, description="GPU type in the request, --gpus-per-node=<type>:<count> (e.g. "
        "'a100'); default: any type."
    )
    exclusive: bool = Field(False, description="sbatch --exclusive: no other job shares the "
                            "nodes.")
    job_root: str | None = Field(
        None, description="Folder on the shared file system that holds one folder per job "
        "(script, job.json, log, result); must be the same path on the Airflow worker and the "
        "compute nodes. Default: <TRAINFORGE_HOME>/runs."
    )
    working_dir: str | None = Field(
        None, description="sbatch --chdir of the job; default: the job's folder."
    )
    python: str = Field(
        "python3", min_length=1, description="Python on the compute nodes that has torch and "
        "trainforge (runs torch.distributed.run); a command on the nodes' PATH or an absolute "
        "path."
    )
    setup: list[str] = Field(
        [], description="Shell lines run by the batch script before launching, e.g. 'module "
        "load cuda/12.4' or 'source /shared/venvs/trainforge/bin/activate'."
    )
    env_vars: dict[str, str] = Field(
        {}, description="Extra environment of every rank. No credentials: names such as "
        "AWS_SECRET_ACCESS_KEY, HF_TOKEN, *_PASSWORD or *_API_KEY are refused (give the nodes "
        "their own credentials)."
    )
    rendezvous_port: int | None = Field(
        None, ge=1024, le=65535, description="TCP port of torchrun's c10d rendezvous on the "
        "job's first node; default 29500 + (Slurm job id mod 10000), so jobs sharing a node "
        "do not collide."
    )
    bin_dir: str | None = Field(
        None, description="Folder of the Slurm commands; default: found on the PATH."
    )

    @field_validator("partition", "account", "qos", "reservation", "gpu_type")
    @classmethod
    def _names(cls, value: str | None, info) -> str | None:
        if value is not None and not _SLURM_NAME.match(value):
            raise ValueError(f"{info.field_name} must be a Slurm name: letters, digits, '_', "
                             f"'.' or '-', at most 64 characters (got {value!r})")
        return value

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_CONSTRAINT.match(value):
            raise ValueError(f"constraint must be a Slurm feature expression: feature names "
                             f"joined by '&', '|' or ',', with '[ ]', '( )' and '*<count>', no "
                             f"spaces (got {value!r})")
        return value

    @field_validator("setup")
    @classmethod
    def _setup_lines(cls, value: list[str]) -> list[str]:
        for line in value:
            if "\n" in line or "\r" in line:
                raise ValueError(f"each setup entry must be one line (got {line!r}; expected "
                                 f"one list item per line)")
        return value

    @field_validator("python", "job_root", "working_dir", "bin_dir")
    @classmethod
    def _no_newline(cls, value: str | None, info) -> str | None:
        if value is not None and any(c in value for c in "\n\r\0"):
            raise ValueError(f"{info.field_name} must be one line (got {value!r})")
        return value

    @field_validator("env_vars")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env_vars(value, "Slurm", "give the nodes credentials of their own "
                               "(instance role, ~/.aws), or read them in training.slurm.setup "
                               "from a protected file", _ENGINE_ENV)
