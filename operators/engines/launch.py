"""How every engine starts the trainer: the torchrun command line and the ranks' environment.

Each engine wraps the same launch in its own request (an argv, a Ray entrypoint, an sbatch
script, a pod command); what differs is only where the paths live and how the group finds its
peers, so those are the parameters here. The trainer side of the contract (exit codes, the result
file) is :mod:`trainforge.contract`.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainforge.contract import JOB_DIR_ENV, RESULT_FILE_ENV
from trainforge.engines.base import TrainingJob

LAUNCH_ENV: dict[str, str] = {
    "PYTHONUNBUFFERED": "1",
    # torchrun (torch >= 2.5) shares its rendezvous TCPStore with the workers and keeps it across
    # elastic restarts with no per-attempt key prefix, so a restarted rank can read a slower
    # peer's address from the previous attempt and fail with "Connection refused"
    # (pytorch/pytorch#135712). Opting out gives every attempt a fresh store hosted by its rank 0.
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}
"""Environment every engine sets for torchrun and its ranks, besides the job's own variables."""

TORCHRUN = ("torchrun",)
"""The launcher on a cluster image's PATH; engines that know the interpreter use
:func:`python_torchrun` instead."""


def python_torchrun(python: str) -> tuple[str, ...]:
    """torchrun run by the interpreter ``python`` (a path, or a command on the PATH)."""
    return (python, "-m", "torch.distributed.run")


def rank_env(job: TrainingJob, result_file: str | None = None,
             job_dir: str | None = None) -> dict[str, str]:
    """The environment the engine gives torchrun and every rank, before the job's own ``env``:
    threads per rank, :data:`LAUNCH_ENV`, the job folder when the engine keeps one on a shared
    disk, and where rank 0 writes its result (None: the engine's launch line sets it)."""
    env = {"OMP_NUM_THREADS": str(job.threads_per_process), **LAUNCH_ENV}
    if job_dir is not None:
        env[JOB_DIR_ENV] = job_dir
    if result_file is not None:
        env[RESULT_FILE_ENV] = result_file
    return env


def torchrun_argv(
    job: TrainingJob,
    config: str,
    *,
    launcher: Sequence[str] = TORCHRUN,
    standalone: bool = True,
    nnodes: str | None = None,
    max_restarts: int | None = None,
    rendezvous: Sequence[str] = (),
    log_dir: str | None = None,
    module: str | None = None,
) -> list[str]:
    """torchrun's command line running ``job.module --config CONFIG``.

    Args:
        job: sizes (``processes_per_node``, ``nodes``, ``max_restarts``) and the module.
        config: the job config's path as the launching shell or process sees it.
        launcher: the command that is torchrun.
        standalone: a single-machine group with its own local rendezvous (``--standalone``).
        nnodes: ``--nnodes`` as written (``"$SLURM_NNODES"``); default ``job.nodes``. The empty
            string leaves it out, for engines that set torchrun's ``PET_*`` environment instead.
        max_restarts: elastic restarts in place; default ``job.max_restarts``.
        rendezvous: ``--rdzv-*`` options of a multi-machine group.
        log_dir: where torchrun keeps every rank's output (``--log-dir`` with ``--tee=3``, rank 0
            on the console); None: the ranks write to the console directly.
        module: the module as written (shell-quoted where a shell reads it); default
            ``job.module``.

    Values are written as given: a caller whose command a shell reads quotes them itself.
    """
    argv = [*launcher]
    if standalone:
        argv.append("--standalone")
    nnodes = str(job.nodes) if nnodes is None else nnodes
    if nnodes:
        argv.append(f"--nnodes={nnodes}")
    argv.append(f"--nproc-per-node={job.processes_per_node}")
    restarts = job.max_restarts if max_restarts is None else max_restarts
    argv.append(f"--max-restarts={restarts}")
    argv += rendezvous
    if log_dir is not None:
        argv += [f"--log-dir={log_dir}", "--tee=3", "--local-ranks-filter=0"]
    argv += ["-m", module or job.module, "--config", config]
    return argv
