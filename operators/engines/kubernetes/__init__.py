"""The ``kubernetes`` engine: a Kubeflow TrainJob or PyTorchJob, optionally queued by Kueue
(:mod:`.backend`; the request in :mod:`.render`, its state in :mod:`.status`)."""

from __future__ import annotations

from typing import Any

from trainforge.engines.kubernetes.spec import KubernetesEngine
from trainforge.engines.descriptors import Engine


def _connection(block: KubernetesEngine, runs_root: str) -> dict[str, Any]:
    return {"namespace": block.namespace, "conn_id": block.connection_id,
            "kubeconfig": block.kubeconfig, "context": block.context}


ENGINE = Engine(
    name="kubernetes",
    title="Kubernetes",
    summary="Kubeflow TrainJob or PyTorchJob",
    block=KubernetesEngine,
    backend="trainforge.engines.kubernetes.backend:KubernetesBackend",
    connection=_connection,
    multi_node=True,
    shared_disk=False,
    needs_image=True,
    secrets_in_memory=False,
    written_request="job manifest",
    secrets_remedy="give the ranks credentials through training.kubernetes.secret_env (a "
    "Kubernetes Secret) or a service-account role",
)
