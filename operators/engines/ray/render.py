"""The ``ray`` engine's request: torchrun as the entrypoint of a job on a Ray cluster's job API.

:func:`render_request` (what :meth:`~trainforge.engines.ray.backend.RayBackend.render`
returns) is the exact keyword arguments of
``ray.job_submission.JobSubmissionClient.submit_job`` (under ``submit_job``): the
``entrypoint`` (a POSIX ``sh`` command on one node; :mod:`trainforge.engines.ray.launcher` on
several), the ``submission_id`` (the job identity's key), the ``runtime_env`` (the job config,
MLflow and the spec's environment; secrets as placeholders until ``submit_job``), ``metadata``
and the entrypoint's CPUs and GPUs. Each key in full: docs/ray.md, "The request".

The job config travels inside the request and the result comes back through the job's log, so
the cluster needs no file system shared with the Airflow worker.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from trainforge.engines.base import TrainingJob
from trainforge.engines.launch import rank_env, torchrun_argv
from trainforge.engines.ray import launcher
from trainforge.errors import BackendError

CONFIG_ENV = launcher.CONFIG_ENV
"""Environment variable that carries the job config (canonical JSON) to the entrypoint."""
RESULT_MARKER = launcher.RESULT_MARKER
"""Prefix of the log line that carries the trainer's result file (docs/contracts.md)."""
# Linux limits one environment string to 128 KiB (MAX_ARG_STRLEN); stay well below it.
MAX_CONFIG_BYTES = 100_000


def render_request(job: TrainingJob, address: str, conn_id: str | None) -> dict[str, Any]:
    """What the backend submits: ``{"engine", "address", "connection_id", "submit_job":
    {...submit_job keyword arguments...}}``. Pure.

    Raises:
        BackendError: the job config is too large for an environment variable.
    """
    opts = job.engine_options or {}
    config = json.dumps(job.config, sort_keys=True, separators=(",", ":"))
    if len(config.encode()) > MAX_CONFIG_BYTES:
        raise BackendError(
            f"job config of {job.identity.key} is {len(config.encode())} bytes; the ray "
            f"engine passes it in the environment variable {CONFIG_ENV}, at most "
            f"{MAX_CONFIG_BYTES} bytes"
        )
    env_vars = {
        **rank_env(job),
        **{str(k): str(v) for k, v in (opts.get("env_vars") or {}).items()},
        **job.env,
        **job.secret_placeholders(),
        CONFIG_ENV: config,
    }
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if opts.get("working_dir"):
        runtime_env["working_dir"] = str(opts["working_dir"])
    if opts.get("pip"):
        runtime_env["pip"] = [str(p) for p in opts["pip"]]
    identity = job.identity
    metadata = {
        "trainforge.dag_id": identity.dag_id,
        "trainforge.run_id": identity.run_id,
        "trainforge.task_id": identity.task_id,
        "trainforge.try_number": str(identity.try_number),
        "trainforge.key": identity.key,
        "trainforge.attempt": "1",
    }
    if job.startup_timeout_s is not None:
        metadata["trainforge.startup_timeout_s"] = num(job.startup_timeout_s)
    node_cpus = float(job.processes_per_node * job.threads_per_process)
    node_words = f"{num(node_cpus)} CPU, {num(job.gpus_per_node)} GPU" + (
        f", {num(job.memory_gib)} GiB memory" if job.memory_gib else "")
    if job.nodes == 1:
        cpus = float(opts.get("entrypoint_num_cpus") or node_cpus)
        gpus = float(opts.get("entrypoint_num_gpus") or job.gpus_per_node)
        # What the entrypoint asks for, in words: Ray's PENDING message does not say.
        metadata["trainforge.resources"] = f"{num(cpus)} CPU, {num(gpus)} GPU" + (
            f", {num(job.memory_gib)} GiB memory" if job.memory_gib else "")
    else:
        # The entrypoint only coordinates; the nodes' resources are the placement group's.
        cpus = float(opts.get("entrypoint_num_cpus") or 0.0)
        gpus = float(opts.get("entrypoint_num_gpus") or 0.0)
        metadata["trainforge.nodes"] = str(job.nodes)
        metadata["trainforge.resources"] = (
            f"entrypoint {num(cpus)} CPU, {num(gpus)} GPU; placement group of {job.nodes} "
            f"bundles of {node_words}, STRICT_SPREAD")
    submit: dict[str, Any] = {
        "entrypoint": entrypoint(job),
        "submission_id": identity.key,
        "runtime_env": runtime_env,
        "metadata": metadata,
        "entrypoint_num_cpus": cpus,
        "entrypoint_num_gpus": gpus,
    }
    if job.memory_gib and job.nodes == 1:
        submit["entrypoint_memory"] = int(job.memory_gib * 2**30)
    return {"engine": "ray", "address": address, "connection_id": conn_id, "submit_job": submit}


def entrypoint(job: TrainingJob) -> str:
    """The job's shell command (POSIX sh; Ray runs it with ``shell=True``)."""
    if job.nodes > 1:
        return multi_node_entrypoint(job)
    torchrun = torchrun_argv(job, '"$d/job.json"', log_dir='"$d/ranks"',
                             module=shlex.quote(job.module))
    return "; ".join([
        f'd="$(mktemp -d "${{TMPDIR:-/tmp}}/trainforge-{job.identity.key}.XXXXXX")" || exit 70',
        f'printf \'%s\' "${CONFIG_ENV}" > "$d/job.json" || exit 70',
        'echo "trainforge: job folder $d on $(uname -n)"',
        'TRAINFORGE_RESULT_FILE="$d/result.json" ' + " ".join(torchrun),
        "rc=$?",
        f'if [ -s "$d/result.json" ]; then printf \'\\n{RESULT_MARKER}%s\\n\' '
        f'"$(tr -d \'\\n\' < "$d/result.json")"; fi',
        "exit $rc",
    ])


def multi_node_entrypoint(job: TrainingJob) -> str:
    """``python -m trainforge.engines.ray.launcher ... -- torchrun ...``: one torchrun per Ray
    node, c10d rendezvous on the first bundle's node; the launcher fills in the placeholders
    (:data:`~trainforge.engines.ray.launcher.JOB_DIR`, ...) on each node."""
    key = job.identity.key
    torchrun = torchrun_argv(
        job, f"{launcher.JOB_DIR}/job.json", standalone=False,
        rendezvous=("--rdzv-backend=c10d", f"--rdzv-endpoint={launcher.RDZV_ENDPOINT}",
                    f"--rdzv-id={key}", f"--rdzv-conf=is_host={launcher.IS_HOST}",
                    f"--local-addr={launcher.LOCAL_ADDR}"),
        log_dir=f"{launcher.JOB_DIR}/ranks")
    argv = ["python", "-m", launcher.MODULE, "--key", key, "--nodes", str(job.nodes),
            "--cpus-per-node", num(job.processes_per_node * job.threads_per_process),
            "--gpus-per-node", num(job.gpus_per_node)]
    if job.memory_gib:
        argv += ["--memory-bytes", str(int(job.memory_gib * 2**30))]
    if job.startup_timeout_s is not None:
        argv += ["--startup-timeout-s", num(job.startup_timeout_s)]
    return shlex.join([*argv, "--", *torchrun])


def parse_result(text: str) -> dict[str, Any] | None:
    """The JSON of the last ``TRAINFORGE_RESULT {...}`` line in ``text``, or None."""
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_MARKER):
            try:
                value = json.loads(line[len(RESULT_MARKER):])
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def num(value: float) -> str:
    """A number as Ray's metadata and messages show it: ``6`` for 6.0, ``0.5``."""
    return f"{value:g}"
