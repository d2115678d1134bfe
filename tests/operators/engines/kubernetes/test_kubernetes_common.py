"""Shared builders for the Kubernetes engine tests (no tests here).

``demo_job`` renders the demo pipeline for the kubernetes engine the way ``trainforge render
--engine kubernetes`` does; ``full_job`` adds everything the engine block can carry (Kueue,
GPUs, several nodes, tolerations, Secrets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainforge.engines.base import JobIdentity, TrainingJob

ROOT = Path(__file__).resolve().parents[4]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"
IDENTITY = JobIdentity("shakespeare_llm", "manual__2026-01-01T00:00:00+00:00", "train", 1)
ENV = {"MLFLOW_TRACKING_URI": "http://mlflow.mlops.svc:5000", "MLFLOW_RUN_ID": "0123456789abcdef"}

FULL_BLOCK: dict[str, Any] = {
    "namespace": "ml-train",
    "queue_name": "team-a",
    "priority_class": "high",
    "service_account": "trainer",
    "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "shm_size_gib": 16,
    "secret_env": [
        {"name": "AWS_ACCESS_KEY_ID", "secret": "s3-credentials", "key": "access-key-id"},
        {"name": "AWS_SECRET_ACCESS_KEY", "secret": "s3-credentials", "key": "secret-access-key"},
    ],
    "image_pull_secrets": ["registry-credentials"],
}


def spec_for(api: str, block: dict[str, Any] | None = None, resources: dict[str, Any] | None = None,
             fault: dict[str, Any] | None = None, optimization: dict[str, Any] | None = None):
    """The demo spec on the kubernetes engine with ``api`` and the extra settings given."""
    from trainforge.pipeline import load_spec
    from trainforge.pipeline.spec import PipelineSpec

    raw = load_spec(DEMO).model_dump(mode="json")
    training = raw["training"]
    training["engine"] = "kubernetes"
    training["local"] = {"distributed_backend": "auto"}
    training["kubernetes"] = {"api": api, **(block or {})}
    training["resources"].update({"image": "ghcr.io/acme/trainforge-trainer:0.1.0", **(resources or {})})
    training["fault"].update(fault or {})
    training["optimization"].update(optimization or {})
    raw["data"]["output_uri"] = "s3://acme-ml/datasets"
    training["checkpoint"]["uri"] = "s3://acme-ml/checkpoints"
    return PipelineSpec.model_validate(raw)


def job_for(spec, identity: JobIdentity = IDENTITY) -> TrainingJob:
    """The engine-neutral job of ``spec`` (as the ``train`` task builds it), with the startup
    timeout the Kubernetes engine enforces."""
    import dataclasses

    from trainforge.jobconfig import build_training_job

    job = build_training_job(
        spec, dataset_dir="s3://acme-ml/datasets/3f2a", checkpoint_dir=(
            f"s3://acme-ml/checkpoints/{identity.dag_id}/{identity.run_id}"),
        identity=identity, env=ENV,
    )
    return dataclasses.replace(job, startup_timeout_s=float(spec.training.fault.startup_timeout))


def demo_job(api: str = "trainjob", identity: JobIdentity = IDENTITY) -> TrainingJob:
    return job_for(spec_for(api), identity)


def full_job(api: str = "trainjob", identity: JobIdentity = IDENTITY) -> TrainingJob:
    spec = spec_for(api, FULL_BLOCK,
                    resources={"nodes": 2, "processes_per_node": 8, "gpus_per_node": 8,
                               "cpus_per_process": 4, "memory_gib": 640},
                    fault={"max_restarts": 2, "startup_timeout": "15m"},
                    optimization={"global_batch_size": 128})
    return job_for(spec, identity)
