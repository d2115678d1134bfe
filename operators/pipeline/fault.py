"""``training.fault``: how a training launch is watched and what its failures may do
(timeouts, restarts, where the task waits, and the policies for a failure after training, a
resume on another world size and a GPU out of memory; docs/faults.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainforge.contract import ON_OOM
from trainforge.pipeline.durations import DurationS
from trainforge.sections import SpecModel, field_errors


class FaultSection(SpecModel):
    max_restarts: int = Field(0, ge=0, le=100, description="torchrun elastic restarts per launch.")
    startup_timeout: DurationS = Field(
        "10m", description="Longest a job may wait to be admitted and start running."
    )
    run_timeout: DurationS = Field("6h", description="Longest a training launch may run.")
    collective_timeout: DurationS = Field(
        "2m", description="Collective timeout: how fast a dead rank is noticed."
    )
    poll_interval: DurationS = Field("5s", description="How often the trigger polls the job.")
    cancel_on_kill: bool = Field(True, description="Cancel the job when the task is killed.")
    deferrable: bool = Field(
        True, description="Wait for the job in the triggerer (true: the worker slot is freed) or "
        "in the worker slot (false: the task process waits, so a kill of that process or "
        "Airflow's execution_timeout reaches the wait directly), like the deferrable option of "
        "Airflow's provider operators."
    )
    post_training_failure: Literal["resume", "accept", "fail"] = Field(
        "resume", description="A job that fails after its training finished and its final "
        "checkpoint is complete (a rank stuck in a collective at exit): 'resume' fails the try "
        "as transient, and the retry resumes at the final step and finishes; 'accept' succeeds "
        "with the final checkpoint; 'fail' fails the task without retries."
    )
    world_size_change: Literal["continue", "refuse"] = Field(
        "continue", description="A retry or restart that resumes a checkpoint on another world "
        "size (nodes x processes_per_node): 'continue' reshards (model and data order survive) "
        "and records it in the checkpoint's world_size_history and the MLflow run; 'refuse' "
        "fails the job permanently (exit 78)."
    )
    on_oom: Literal[ON_OOM] = Field(
        "fail", description="A GPU out of memory in any rank (exit 80, named with the rank, step and "
        "phase): 'fail' fails the task without retries, saying what to change; 'shrink_micro_batch' "
        "retries (the task's next try, resuming the newest checkpoint) at half the micro-batch and "
        "twice the gradient accumulation, the same global batch, down to a micro-batch of 1; each "
        "shrink is recorded in the try record and the ledger."
    )

    @model_validator(mode="after")
    def _poll_fits(self) -> FaultSection:
        if self.poll_interval >= self.run_timeout:
            raise field_errors(FaultSection, (("poll_interval",), f"poll_interval must be "
                               f"shorter than run_timeout (got {self.poll_interval:g} s >= "
                               f"{self.run_timeout:g} s)", self.poll_interval, ()))
        return self
