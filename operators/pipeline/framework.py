"""``training.framework``: how the model is computed and spread over the ranks (precision,
DDP or FSDP, gradient compression, activation checkpointing, torch.compile and what a compile
limit does). The job config's ``framework`` section is rendered from it (trainforge.jobconfig).
"""

from __future__ import annotations

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
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast precision of forward and backward (fp16 uses loss scaling)."
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
