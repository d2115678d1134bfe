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
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")


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


class EvalSection(SpecModel):
    """A task score in the eval gate: prompts answered by greedy generation (docs/registry.md)."""

    prompts: str = Field(
        description="JSONL file (local path, relative to TRAINFORGE_HOME) of "
        '{"prompt": ..., "expected": ...} records; each prompt is one user turn, answered '
        "greedily through the chat template."
    )
    scoring: Literal["exact_match", "contains"] = Field(
        "exact_match",
        description="exact_match: the answer equals expected (both stripped of surrounding "
        "whitespace); contains: the answer contains expected (stripped). The task score is the "
        "fraction correct.",
    )
    max_new_tokens: int = Field(
        32, ge=1, le=4096, description="Tokens generated per prompt at most (generation also "
        "stops at the model's end-of-turn or EOS ids)."
    )
    require_at_least_champion: bool = Field(
        True, description="The candidate's task score must be at least the champion's (a tie "
        "passes on to the validation loss rule)."
    )
    min_score: float | None = Field(
        None, ge=0.0, le=1.0, description="The candidate's task score must be at least this "
        "(the first version too). null: no threshold."
    )
    chat_template: str | None = Field(
        None, description="A Jinja chat template file (local path) to render the prompts with, "
        "for every model compared. null: data.chat_template when given, else each model's own."
    )

    @field_validator("prompts", "chat_template")
    @classmethod
    def _local_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise ValueError(f"registry.eval.{info.field_name} may not be empty (got {value!r}; "
                             "expected a local file path)")
        if _SCHEME.match(value):
            example = "eval/prompts.jsonl" if info.field_name == "prompts" else "templates/chat.jinja"
            raise ValueError(f"registry.eval.{info.field_name} is a local file (got {value!r}; expected "
                             f"e.g. {example!r}, relative to TRAINFORGE_HOME)")
        return value


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
    eval: EvalSection | None = Field(
        None, validate_default=False, description="A task score the eval gate also requires (docs/registry.md): "
        "prompts answered by greedy generation, candidate and champion scored alike. "
        "null: the gate compares validation loss only."
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

    @field_validator("eval", mode="before")
    @classmethod
    def _eval_given(cls, value: object, info: ValidationInfo) -> object:
        # As with approval: ``eval:`` with nothing after it would silently turn the task score off.
        if value is None and (info.context or {}).get(SPEC_FILE):
            raise ValueError(
                "empty (got nothing after 'eval:'; expected its settings, at least "
                "'prompts: <file.jsonl>'; remove the key to gate on validation loss only)"
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
