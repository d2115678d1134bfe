"""Exceptions of the trainer, each carrying the exit code and result status it maps to.

The codes are the ones in docs/contracts.md ("Trainer exit codes and result file"):

| exception        | exit code | result status | orchestrator                          |
|------------------|-----------|---------------|---------------------------------------|
| ConfigError      | 78        | bad_config    | permanent: fail, no retry             |
| DatasetError     | 78        | bad_config    | permanent (a dataset that does not verify) |
| DivergedError    | 79        | diverged      | permanent                             |
| GpuOutOfMemoryError | 80     | out_of_memory | permanent, or a retry at a smaller micro-batch (training.fault.on_oom) |
| CheckpointError  | 1         | error         | transient: retry, resume              |
| TerminatedError  | 143       | error         | transient (SIGTERM; a BaseException)  |
| any other        | 1         | error         | transient                             |

78 is ``EX_CONFIG`` from sysexits.h; 79 and 80 are trainforge's own. The codes and statuses are the
job contract's (:mod:`trainforge.contract`), which the orchestrator classifies with.
"""

from __future__ import annotations

from trainforge.contract import (
    EXIT_CONFIG, EXIT_DIVERGED, EXIT_ERROR, EXIT_OOM, EXIT_TERMINATED, STATUS_BAD_CONFIG, STATUS_DIVERGED, STATUS_ERROR,
    STATUS_OOM,
)


class TrainerError(Exception):
    """Base class: something the trainer detected and can describe. Exit code 1."""

    exit_code: int = EXIT_ERROR
    status: str = STATUS_ERROR


class ConfigError(TrainerError):
    """The job config (or the world size it is run with) is invalid. Exit code 78.

    Messages name the field path (``optim.micro_batch_size``), the value given and what was
    expected.
    """

    exit_code = EXIT_CONFIG
    status = STATUS_BAD_CONFIG


class DatasetError(ConfigError):
    """The dataset folder named by ``data.dataset_dir`` is missing or does not verify. Exit 78."""


class DivergedError(TrainerError):
    """Training produced a non-finite loss, gradient norm or weight. Exit code 79."""

    exit_code = EXIT_DIVERGED
    status = STATUS_DIVERGED


class GpuOutOfMemoryError(TrainerError):
    """A CUDA out of memory in this rank, named with the step, the phase and the memory asked
    for and free (``record``: trainforge.trainer.oom). Exit code 80."""

    exit_code = EXIT_OOM
    status = STATUS_OOM

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


class CheckpointError(TrainerError):
    """A checkpoint could not be written or read back. Exit code 1 (transient: retried)."""


class TerminatedError(BaseException):
    """The process received SIGTERM (torchrun stopping the worker group). Exit code 143.

    A BaseException, like KeyboardInterrupt, because it is raised from a signal handler at any
    point: library code that catches ``Exception`` (logging's ``Handler.emit`` does) must not
    swallow it.
    """

    exit_code = EXIT_TERMINATED
    status = STATUS_ERROR
