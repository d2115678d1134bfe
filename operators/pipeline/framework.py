"""``training.framework``: how the model is computed and spread over the ranks (precision,
DDP or FSDP, gradient compression, activation checkpointing, torch.compile and what a compile
limit does). The job config's ``framework`` section is rendered from it (trainforge.jobconfig).
`fp8_device_errors` and `fp8_token_errors`: what ``precision: fp8`` asks of the GPUs and batches.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from trainforge.contract import COMPILE_FALLBACKS
from trainforge.sections import SpecModel, field_errors


def _compile_setting(value: Any) -> Any:
    """``training.framework.compile``: exactly ``auto``, ``true`` or ``false``.

    pydantic's lax mode would read ``"yes"``, ``"true"`` or ``1`` as a boolean; this refuses them
    here, before the ``Literal["auto"] | bool`` type sees them. None passes through (a stage's
    override model reads it as "inherit"; the section's own type refuses it).
    """
    if value is None or isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value
    expected = "expected 'auto', true or false"
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "false"):
            raise ValueError(f"a quoted boolean is text; write {word} without quotes "
                             f"(got {value!r}; {expected})")
        hint = "; did you mean 'auto'?" if word == "auto" else ""
        raise ValueError(f"unknown value (got {value!r}; {expected}{hint})")
    if isinstance(value, (int, float)):
        raise ValueError(f"a number is not a compile setting (got {value!r}; {expected})")
    shown = "a mapping" if isinstance(value, dict) else "a list" if isinstance(value, list) else repr(value)
    raise ValueError(f"wrong kind of value (got {shown}; {expected})")


#: ``auto`` (torch.compile on CUDA, not on the CPU), or true/false to force it either way.
CompileSetting = Annotated[Literal["auto"] | bool, BeforeValidator(_compile_setting)]


class FrameworkSection(SpecModel):
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32", description="Autocast precision of forward and backward (fp16 uses loss scaling; "
        "fp8: float8 linears under bf16 autocast, on GPUs of compute capability 8.9 or higher)."
    )
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp", description="Data parallelism: replicated (DDP) or sharded (FSDP) parameters."
    )
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="DDP communication hook compressing gradients before all-reduce."
    )
    powersgd_rank: int = Field(1, ge=1, le=64, description="Rank of PowerSGD's approximation.")
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save memory."
    )
    compile: CompileSetting = Field(
        "auto", description="Compile each decoder layer with torch.compile: true, false, or "
        "auto (on when training on CUDA GPUs, off on the CPU)."
    )
    compile_fallback: Literal[COMPILE_FALLBACKS] = Field(  # type: ignore[valid-type]
        "error", description="When Dynamo's recompile or cache-size limit leaves a compiled "
        "function to run eagerly: error (the run fails, exit 78) or warn (it says so once and "
        "trains on partly eager, tagged compile/mode=partly_eager)."
    )

    @model_validator(mode="after")
    def _combination(self) -> FrameworkSection:
        if self.parallelism == "fsdp" and self.gradient_compression != "none":
            raise field_errors(FrameworkSection, (
                ("gradient_compression",), f"gradient_compression is a DDP communication hook "
                f"and does not apply to FSDP (got {self.gradient_compression!r} with parallelism "
                f"'fsdp'; expected 'none')", self.gradient_compression, ("parallelism",)))
        return self


#: GPU types without float8 tensor cores (compute capability below 8.9), as a Slurm ``gpu_type``
#: or a device name spells them: matched against each word of the name, lower case.
NO_FLOAT8 = frozenset({"a100", "a800", "a40", "a30", "a16", "a10", "a10g", "a2", "a6000", "a5000", "a4000",
                       "v100", "t4", "p100", "p40", "p4", "k80", "rtx3090", "rtx3080", "rtx2080"})
FP8_REQUIREMENT = "float8 training needs CUDA GPUs of compute capability 8.9 or higher (H100, H200, L4, L40S, Ada)"
#: float8 matmuls need the tokens of a micro-batch (their inner dimension in the weight gradient)
#: divisible by this.
FP8_TOKEN_MULTIPLE = 16


def fp8_device_errors(training: Any) -> list[tuple]:
    """``precision: fp8`` on a job without GPUs, or on a GPU type the spec names (the Slurm
    block's ``gpu_type``) that has no float8 matmuls; unnamed types are checked by the trainer."""
    if training.framework.precision != "fp8":
        return []
    loc, resources = ("framework", "precision"), training.resources
    if not resources.gpus_per_node:
        return [(loc, f"precision 'fp8': {FP8_REQUIREMENT}, and the job requests none (got "
                 f"resources.gpus_per_node 0; expected gpus_per_node of 1 or more on such GPUs, or "
                 f"precision 'bf16')", "fp8", ())]
    gpu_type = getattr(getattr(training, training.engine, None), "gpu_type", None)
    if gpu_type and NO_FLOAT8 & set(re.split(r"[^a-z0-9]+", gpu_type.lower())):
        return [(loc, f"precision 'fp8': {FP8_REQUIREMENT}, and training.{training.engine}.gpu_type "
                 f"{gpu_type!r} names an older one (expected such a gpu_type, or precision 'bf16')", "fp8", ())]
    return []


def fp8_token_errors(training: Any, sequence_length: int) -> list[tuple]:
    """``precision: fp8`` with micro_batch_size x sequence_length not divisible by 16."""
    micro = training.optimization.micro_batch_size
    if training.framework.precision != "fp8" or micro * sequence_length % FP8_TOKEN_MULTIPLE == 0:
        return []
    return [(("training", "optimization", "micro_batch_size"), f"precision 'fp8' needs the tokens of a "
             f"micro-batch divisible by {FP8_TOKEN_MULTIPLE} (got micro_batch_size {micro} x "
             f"data.sequence_length {sequence_length} = {micro * sequence_length}; expected a "
             f"multiple of {FP8_TOKEN_MULTIPLE}, e.g. sequence_length "
             f"{-(-sequence_length // FP8_TOKEN_MULTIPLE) * FP8_TOKEN_MULTIPLE})", micro,
             ("training", "framework", "precision"))]
