"""The ``validation`` and ``registry`` sections of a pipeline spec: what a checkpoint must meet
before it is registered, and how it is registered in the MLflow model registry."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from operators.spec.base import SpecModel

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,255}$")
_ALIAS = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,254}$")


class ValidationSection(SpecModel):
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


class RegistrySection(SpecModel):
    model_name: str = Field(description="MLflow registered model name.")
    aliases: list[str] = Field(
        default_factory=lambda: ["challenger"], description="Aliases set on the new version."
    )
    tags: dict[str, str] = Field(default_factory=dict, description="Tags on the model version.")

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, value: str) -> str:
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
            if not _ALIAS.match(alias) or re.fullmatch(r"[vV]\d+|latest", alias):
                raise ValueError(
                    f"not a valid MLflow alias (got {alias!r}; expected a name that starts with a "
                    f"letter and is not 'latest' or 'v<number>')"
                )
        return value
