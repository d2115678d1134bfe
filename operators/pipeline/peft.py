"""``training.peft``: LoRA adapters on ``model.pretrained`` (docs/finetuning.md, "LoRA")."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from trainforge.sections import SpecModel

#: A module name as peft matches it: the last part of a dotted path.
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class PeftSection(SpecModel):
    method: Literal["lora"] = Field("lora", description="The adapter method; LoRA through peft.")
    r: int = Field(16, ge=1, le=4096, description="LoRA rank: the inner size of each adapter's A and B.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the adapters' output is scaled by alpha / r.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on each adapter's input while training.")
    target_modules: Literal["auto"] | list[str] = Field(
        "auto", description="The linear layers LoRA wraps, by name (e.g. [q_proj, v_proj]); auto: the "
        "attention and MLP projections of the model's family (llama, mistral, qwen2/3, gemma 1-3, phi3, "
        "olmo2, ...). A name matching no linear layer of the model fails the training task."
    )
    merge: bool = Field(
        True, description="Register merged full weights (the adapters folded into the base). false: register "
        "the adapter alone (peft's adapter_config.json and adapter_model.safetensors, with the tokenizer) and a "
        "reference to its base model's local folder, which must be reachable where the model is loaded; needs "
        "an MLflow whose mlflow.transformers.save_model takes base_model_path (docs/finetuning.md)."
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("target_modules may not be an empty list (got []; expected 'auto' or names "
                                 "such as [q_proj, v_proj])")
            bad = [v for v in value if not _MODULE.match(v)]
            if bad:
                raise ValueError(f"not module names: {bad} (expected names such as 'q_proj': letters, digits "
                                 "and '_')")
        return value
