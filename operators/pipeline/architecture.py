"""The spec's ``model`` section: the Llama architecture to train, or the registered model to
continue from."""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainforge.pipeline.data import _MODELS
from trainforge.pipeline.llama_keys import FIRST_CLASS, FIRST_CLASS_ALIASES, OVERRIDABLE
from trainforge.sections import SpecModel, field_errors


def _json_type(value: object) -> str:
    """The JSON type name of a scalar: null, bool, int, float or str."""
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str"}[type(value)]


class ModelSection(SpecModel):
    family: Literal["llama"] = Field("llama", description="Architecture family (transformers).")
    hidden_size: int = Field(256, ge=8, le=65_536, description="Model width d_model.")
    num_layers: int = Field(4, ge=1, le=512, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, le=1024, description="Attention heads.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (grouped-query attention); default num_heads."
    )
    intermediate_size: int | None = Field(
        None, ge=8, description="MLP width; default 8/3 x hidden_size rounded up to 64 (Llama)."
    )
    rope_theta: float = Field(10_000.0, gt=0, description="RoPE base.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Attention dropout probability.")
    tie_word_embeddings: bool = Field(True, description="Share input and output embeddings.")
    config_overrides: dict[str, bool | int | float | str | None] = Field(
        {}, description="Further transformers LlamaConfig keys, e.g. {rms_norm_eps: 1e-5, "
        "attention_bias: true}: " + ", ".join(sorted(OVERRIDABLE)) + ". Keys set by the fields "
        "above (hidden_size, rope_theta, ...) or by the dataset (vocab_size) are refused.",
        json_schema_extra={"propertyNames": {"enum": sorted(OVERRIDABLE)}},
    )
    init_from: str | None = Field(
        None, description="Continue training a registered model: 'models:/<name>@<alias>' or "
        "'models:/<name>/<version>'. Its weights start the run (a fresh optimizer); the fields "
        "above must describe its architecture, and data.tokenizer.source must be the same URI "
        "(its tokenizer). A checkpoint of the run's own takes precedence on a retry. null: "
        "random initialisation."
    )

    @field_validator("init_from")
    @classmethod
    def _registered_model(cls, value: str | None) -> str | None:
        if value is not None and not _MODELS.match(value):
            raise ValueError(f"not a registered model URI (got {value!r}; expected "
                             f"'models:/<name>@<alias>' or 'models:/<name>/<version>')")
        return value

    @field_validator("config_overrides")
    @classmethod
    def _known_config_keys(cls, value: dict) -> dict:
        errors = []
        for key, given in value.items():
            if key in FIRST_CLASS or key in FIRST_CLASS_ALIASES:
                source = FIRST_CLASS.get(key) or FIRST_CLASS_ALIASES[key]
                errors.append(((key,), f"{key} is set by {source}, not by an override (got "
                               f"{given!r}; expected it there)", given, ()))
            elif key not in OVERRIDABLE:
                close = difflib.get_close_matches(key, list(OVERRIDABLE), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else (
                    "expected one of: " + ", ".join(sorted(OVERRIDABLE)))
                errors.append(((key,), f"not a LlamaConfig key trainforge lets you set (got "
                               f"{key!r}; {hint})", key, ()))
            elif _json_type(given) not in OVERRIDABLE[key] and not (
                    _json_type(given) == "int" and "float" in OVERRIDABLE[key]):
                errors.append(((key,), f"wrong type for {key} (got {given!r}; expected "
                               f"{' or '.join(OVERRIDABLE[key])})", given, ()))
        if errors:
            raise field_errors(ModelSection, *errors)
        return value

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        errors = []
        if self.hidden_size % self.num_heads:
            errors.append((
                ("num_heads",), f"hidden_size must be divisible by num_heads (got hidden_size "
                f"{self.hidden_size} and num_heads {self.num_heads})", self.num_heads,
                ("hidden_size",)))
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            errors.append((
                ("num_kv_heads",), f"num_heads must be divisible by num_kv_heads (got "
                f"{self.num_heads} and {kv})", kv, ("num_heads",)))
        if errors:
            raise field_errors(ModelSection, *errors)
        return self

    @property
    def resolved_intermediate_size(self) -> int:
        """MLP width; Llama's default is 8/3 x d_model rounded up to a multiple of 64."""
        if self.intermediate_size:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64
