"""The ``ray`` engine's spec block, ``training.ray``: the cluster's job API and the job's
runtime environment."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from trainforge.engines.blocks import check_env_vars, socket_interfaces_checked
from trainforge.sections import SpecModel


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
        "resources.cpus_per_process (with resources.nodes > 1: none, as each node's CPUs are "
        "reserved by its placement group bundle)."
    )
    entrypoint_num_gpus: float = Field(
        0.0, ge=0, description="GPUs reserved for the entrypoint; default: "
        "resources.gpus_per_node (with resources.nodes > 1: none)."
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
        return check_env_vars(value, "Ray", "S3 credentials come from storage.aws_conn_id, "
                               "others from the Ray cluster's own environment or secrets")

    @model_validator(mode="after")
    def _socket_interfaces(self) -> RayEngine:
        return socket_interfaces_checked(self)
