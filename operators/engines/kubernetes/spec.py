"""The ``kubernetes`` engine's spec block, ``training.kubernetes``: where the cluster is and
what the pods carry besides their size (``training.resources``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainforge.engines.blocks import DNS_SUBDOMAIN, ENGINE_ENV, ENV_NAME, dns_name
from trainforge.sections import SpecModel


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
        if not ENV_NAME.match(value):
            raise ValueError(f"not an environment variable name (got {value!r}; expected "
                             f"letters, digits and '_', not starting with a digit)")
        return value

    @field_validator("secret")
    @classmethod
    def _secret_name(cls, value: str) -> str:
        return dns_name(value, "secret", DNS_SUBDOMAIN)


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
        return None if value is None else dns_name(value, info.field_name)

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: list[str]) -> list[str]:
        return [dns_name(v, "image_pull_secrets", DNS_SUBDOMAIN) for v in value]

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, value: list[SecretEnv]) -> list[SecretEnv]:
        names = [item.name for item in value]
        for name in names:
            if name in ENGINE_ENV:
                raise ValueError(f"secret_env may not set {name}: the engine sets it (expected "
                                 f"names other than {', '.join(sorted(ENGINE_ENV))})")
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
