"""The ``local`` engine's spec block, ``training.local``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainforge.sections import SpecModel


class LocalEngine(SpecModel):
    distributed_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend; auto = nccl with GPUs, gloo on CPU."
    )
