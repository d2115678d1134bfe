"""The ``slurm`` engine's spec block, ``training.slurm``: the batch request's options and how
the nodes start Python."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from trainforge.engines.blocks import ENGINE_ENV, check_env_vars, socket_interfaces_checked
from trainforge.sections import SpecModel, check_length


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
        if value is not None:
            check_length(value, 64, info.field_name)
        if value is not None and not _SLURM_NAME.match(value):
            raise ValueError(f"{info.field_name} must be a Slurm name: letters, digits, '_', "
                             f"'.' or '-', at most 64 characters (got {value!r})")
        return value

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, value: str | None) -> str | None:
        if value is not None:
            check_length(value, 256, "constraint")
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
        return check_env_vars(value, "Slurm", "give the nodes credentials of their own "
                               "(instance role, ~/.aws), or read them in training.slurm.setup "
                               "from a protected file", ENGINE_ENV)

    @model_validator(mode="after")
    def _socket_interfaces(self) -> SlurmEngine:
        return socket_interfaces_checked(self)
