"""SGLang's weight and control routes as pydantic models: loads from disk, from tensors and from a
process-group broadcast (with the group's lifecycle), LoRA adapters by name, memory release, the version
tag. Built on `protocol`'s `WireModel`: unknown fields are rejected, refusals name the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from verst.inference_client.protocol import WireModel


class UpdateWeightsFromDiskRequest(WireModel):
    model_path: str = Field(..., min_length=1)
    load_format: Literal["auto", "safetensors"] | None = None
    weight_version: str | None = Field(None, min_length=1)
    abort_all_requests: bool = False


class AdapterPush(WireModel):
    """verst's extension of the tensor and distributed weight updates: with `lora_name`, the tensors are a
    whole PEFT LoRA adapter (A and B of each targeted layer, PEFT's names) and `lora_config` its
    adapter_config.json; the engine serves it under that name, replacing the adapter loaded there, and
    requests in flight on that adapter go on with the new one, as after a full-weight update."""

    lora_name: str | None = Field(None, min_length=1)
    lora_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _both(self) -> AdapterPush:
        if (self.lora_name is None) != (self.lora_config is None):
            raise ValueError("lora_name and lora_config go together: an adapter push needs both")
        return self


class UpdateWeightsFromTensorRequest(AdapterPush):
    """`serialized_named_tensors`: one entry per tensor-parallel rank (one here), SGLang's pickled list of
    (name, tensor); see `tensor_payload.py`."""

    serialized_named_tensors: list[str] = Field(..., min_length=1, max_length=1)
    load_format: None = Field(None, description="SGLang's default format only: the entry is a list of (name, "
                              "tensor) copied into the parameters of those names.")
    flush_cache: bool = True
    weight_version: str | None = Field(None, min_length=1)
    abort_all_requests: bool = False


# The largest weight-update group the engine joins: one trainer and its engines. gloo's full-mesh rendezvous
# costs every rank memory and store traffic in the group's size (~90 MB at 2**16 ranks; at 2**20 the store
# refuses the payload), so a larger world_size is refused before the engine dials anyone.
MAX_WORLD_SIZE = 2**16
# An IP address (v4, or v6 in hex and colons) or a hostname of ASCII labels; anything else cannot name a host.
_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
HOST_PATTERN = rf"^(?:{_HOST_LABEL}(?:\.{_HOST_LABEL})*|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$"
# Joining takes well under a second when the trainer opens the group as it asks the engines to join, as
# verst's does; 30 s leaves room for a loaded machine, and a wrong or unreachable master is reported then.
JOIN_TIMEOUT_S = 30.0


class InitWeightsUpdateGroupRequest(WireModel):
    master_address: str = Field(..., min_length=1, max_length=253, json_schema_extra={"pattern": HOST_PATTERN},
                                description="The trainer's (rank 0's) IP address or hostname.")
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: int = Field(..., ge=1, le=MAX_WORLD_SIZE - 1, description="Rank 0 is the trainer that broadcasts.")
    world_size: int = Field(..., ge=2, le=MAX_WORLD_SIZE, description="The trainer and every engine of the group.")
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(JOIN_TIMEOUT_S, gt=0, le=3600, description="verst: seconds to wait for the master "
                             "and every rank to join, and for each broadcast received in the group.")

    @field_validator("master_address")
    @classmethod
    def _host(cls, value: str) -> str:
        if re.fullmatch(HOST_PATTERN, value) is None:
            raise ValueError("not an IP address or a hostname (ASCII letters, digits, '-' and '_' in dot-separated "
                             "labels); give the trainer's address as this engine reaches it")
        return value

    @model_validator(mode="after")
    def _rank(self) -> InitWeightsUpdateGroupRequest:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset = {self.rank_offset} must be below world_size = {self.world_size}")
        return self


class DestroyWeightsUpdateGroupRequest(WireModel):
    group_name: str = Field("weight_update_group", min_length=1)


class UpdateWeightsFromDistributedRequest(AdapterPush):
    names: list[str] = Field(..., min_length=1)
    dtypes: list[str] = Field(..., min_length=1)
    shapes: list[list[Annotated[int, Field(ge=0)]]] = Field(..., min_length=1)
    group_name: str = Field("weight_update_group", min_length=1)
    flush_cache: bool = True
    weight_version: str | None = Field(None, min_length=1)
    abort_all_requests: bool = False
    load_format: Literal["flattened_bucket"] | None = Field(
        None, description="'flattened_bucket': the tensors (one dtype) come end to end in one broadcast; "
                          "None: one broadcast per tensor, in the order of names.")

    @model_validator(mode="after")
    def _aligned(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have equal lengths, got {len(self.names)}, "
                f"{len(self.dtypes)}, {len(self.shapes)}"
            )
        return self


class LoadLoraAdapterRequest(WireModel):
    """SGLang `POST /load_lora_adapter`: a PEFT adapter directory served under `lora_name` (replacing an
    adapter loaded under that name)."""

    lora_name: str = Field(..., min_length=1)
    lora_path: str = Field(..., min_length=1)
    pinned: bool = False  # SGLang's GPU-slot pinning; every loaded adapter stays resident here
    update_in_flight: bool = Field(False, description="verst: requests in flight on the replaced adapter go on "
                                   "with the new one (a weight sync) instead of finishing on the old one.")


class UnloadLoraAdapterRequest(WireModel):
    lora_name: str = Field(..., min_length=1)


class MemoryOccupationRequest(WireModel):
    """SGLang's `/release_memory_occupation` and `/resume_memory_occupation`: what to give back to (or take
    back from) a colocated trainer."""

    tags: list[Literal["weights", "kv_cache"]] | None = Field(
        None, description="weights: the model's weights leave the device; kv_cache: the KV storage and prefix cache "
                          "are dropped. None: both (release), or every released one (resume).")


class UpdateWeightVersionRequest(WireModel):
    new_version: str = Field(..., min_length=1)
    abort_all_requests: bool = False


class SetCoresRequest(WireModel):
    """verst's `/set_cores` (the embedded engine on CPU): the cores it computes on from now on and its torch
    intra-op threads, as the run's core budget hands them out."""

    cores: list[Annotated[int, Field(ge=0)]] = Field(..., min_length=1, description="CPU ids (the process's affinity)")
    threads: int = Field(..., ge=1, le=1024, description="torch intra-op threads of the engine's forward")
