"""The ``validation`` and ``registry`` sections of a pipeline spec: what a checkpoint must meet
before it is registered, and how it is registered in the MLflow model registry."""

from __future__ import annotations

import re

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from trainforge.pipeline.approval import ApprovalSection
from trainforge.sections import SpecModel, check_length

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,255}$")
_ALIAS = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,254}$")


# The validation context key the loader sets when it validates what a person wrote in a file.
SPEC_FILE = "spec_file"

GateMetric = Literal["val_bits_per_byte", "val_loss", "val_perplexity"]


class GateSection(SpecModel):
    """When a validated, registered version takes the ``champion`` alias (docs/registry.md)."""

    enabled: bool = Field(
        True, description="Compare each new version with the champion; false: never move champion."
    )
    metric: GateMetric = Field(
        "val_bits_per_byte",
        description="Lower is better. Models with different tokenizers are always compared by "
        "val_bits_per_byte.",
    )
    min_improvement: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="Relative improvement over the champion needed to take the alias "
        "(0.01 = 1% lower); 0 = any strict improvement.",
    )


class ValidationSection(SpecModel):
    policy: Literal["newest", "best_val_loss"] = Field(
        "newest",
        description="Checkpoint validated: the newest one, or the lowest validation loss among "
        "all valid ones.",
    )
    max_val_loss: float | None = Field(None, gt=0, description="Fail when validation loss is above.")
    max_val_perplexity: float | None = Field(
        None, gt=1, description="Fail when validation perplexity is above."
    )
    require_beats_unigram: bool = Field(
        True, description="Fail unless validation perplexity is below the unigram baseline."
    )
    eval_tokens: int = Field(65_536, ge=64, description="Validation tokens evaluated (at most).")
    sample_prompt: str = Field("ROMEO:", description="Prompt of the greedy sample in the report.")
    sample_tokens: int = Field(40, ge=0, le=1024, description="Tokens generated for the sample.")
    gate: GateSection = Field(
        default_factory=GateSection, description="Eval gate against the champion version."
    )


class RegistrySection(SpecModel):
    model_name: str = Field(description="MLflow registered model name.")
    aliases: list[str] = Field(
        default_factory=lambda: ["challenger"],
        description="Aliases set on every new version; 'champion' is reserved for the eval gate.",
    )
    tags: dict[str, str] = Field(default_factory=dict, description="Tags on the model version.")
    approval: ApprovalSection | None = Field(
        None, validate_default=False,
        description="A person approves each eval-gate pass before champion moves "
        "(docs/registry.md); unset: champion moves as soon as the gate passes.",
    )

    @field_validator("approval", mode="before")
    @classmethod
    def _approval_given(cls, value: object, info: ValidationInfo) -> object:
        # In a file, ``approval:`` with nothing after it reads as null, which would silently mean
        # "no approval": the opposite of what writing the key asks for. (A dumped spec carries
        # null for "unset": only the loader's reading of a file passes SPEC_FILE.)
        if value is None and (info.context or {}).get(SPEC_FILE):
            raise ValueError(
                "empty (got nothing after 'approval:'; expected its settings, such as "
                "'approvers: [<user>, ...]', or '{}' for the defaults; remove the key to let "
                "champion move as soon as the gate passes)"
            )
        return value

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, value: str) -> str:
        check_length(value, 256, "a registered model name")
        if not _MODEL_NAME.match(value):
            raise ValueError(
                f"not a valid registered model name (got {value!r}; expected letters, digits, "
                f"'_', '.', '-')"
            )
        return value

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, value: list[str]) -> list[str]:
        for alias in value:
            if alias == "champion":
                raise ValueError(
                    "'champion' is moved only by the eval gate (validation.gate), never set on "
                    "registration (got aliases " + repr(value) + "; remove 'champion')"
                )
            check_length(alias, 255, "an MLflow alias")
            if not _ALIAS.match(alias) or re.fullmatch(r"[vV]\d+|latest", alias):
                raise ValueError(
                    f"not a valid MLflow alias (got {alias!r}; expected a name that starts with a "
                    f"letter and is not 'latest' or 'v<number>')"
                )
        return value
