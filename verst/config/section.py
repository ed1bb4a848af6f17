"""The base of every config section, and the small types several sections share."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict

# Which model class runs a checkpoint: verst's native one (dense Llama-family, built without transformers:
# verst.models.native), transformers', or auto (native where it applies).
ModelImpl = Literal["auto", "native", "transformers"]
MODEL_IMPLS: tuple[str, ...] = get_args(ModelImpl)
# Ray resources a placement bundle sets itself (verst_slot: the CPU placement's unit, see
# verst.orchestration.ray_session); cluster.*_resources name custom ones besides.
RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory", "verst_slot")



class Section(BaseModel):
    """Base of every config section: unknown keys are rejected, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


