"""`SamplingKnobs`: the sampling fields the config, the wire protocol and the engine all speak, declared
once with their defaults, ranges and checks; each of those extends it with the fields only it has."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field, model_validator


class SamplingKnobs(BaseModel):
    """Temperature, top-p and top-k. `error_prefix` names where the fields sit in error messages."""

    error_prefix: ClassVar[str] = ""

    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 keeps all.")

    @model_validator(mode="after")
    def _top_k_not_zero(self) -> SamplingKnobs:
        if self.top_k == 0:
            raise ValueError(f"{self.error_prefix}top_k = 0 keeps no token; use -1 for all or a positive k")
        return self
