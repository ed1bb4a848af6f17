"""A model as FSDP2 shards it: read on every rank, LoRA adapters added, split by the tensor-parallel plan over
the mesh's "tp" axis where it has one, each transformer block and then the whole model passed to `fully_shard`
over the data-parallel axis; and full tensors gathered back in buckets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from verst.config.schema import LoraConfig, ModelConfig
from verst.models.native import load_causal_lm
from verst.trainer import lora as lora_mod
from verst.trainer.critic import add_value_head
from verst.trainer.tensor_parallel import parallelize
from verst.types import WeightBucket

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_sharded(path: str, model_cfg: ModelConfig, mesh: DeviceMesh, *, trainable: bool, value_head: bool = False,
                  gradient_checkpointing: bool = False, lora: LoraConfig | None = None,
                  adapters: dict[str, LoraConfig] | None = None) -> torch.nn.Module:
    """The model at `path`, sharded over `mesh`. Every rank reads the checkpoint and keeps only its shard after
    fully_shard. Parameters are float32 master weights whatever the compute dtype (`model_cfg.dtype`). `impl`
    auto on CUDA keeps transformers' model, whose flash attention takes packed sequences; on CPU the native one
    skips transformers' import. `value_head`: PPO's critic; `lora`: adapters on it (the base frozen). A mesh
    with dims ("dp", "tp") applies the tensor-parallel plan over "tp" first (`verst.trainer.tensor_parallel`)."""
    impl = model_cfg.impl
    if impl == "auto" and mesh.device_type != "cpu":
        impl = "transformers"
    model = load_causal_lm(path, impl, dtype="float32", device="cpu", trust_remote_code=model_cfg.trust_remote_code,
                           trainable=trainable)
    if value_head:
        model = add_value_head(model)
    if trainable and gradient_checkpointing:
        enable_activation_checkpointing(model)
    if lora is not None:
        model = lora_mod.add_adapters(model, lora, adapters or {})  # the base frozen; FSDP2 shards it
    if mesh.mesh_dim_names == ("dp", "tp"):
        parallelize(model, mesh["tp"])
        mesh = mesh["dp"]
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[model_cfg.dtype], reduce_dtype=torch.float32)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    if not block_names:
        raise ValueError(f"model at {path} names no transformer block class (_no_split_modules); cannot shard")
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # also moves the shards to the mesh device
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return model


def full_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """Full tensors (a DTensor gathered: collective) in buckets of about `bucket_bytes`."""
    bucket: WeightBucket = []
    size = 0
    for name, tensor in tensors:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        nbytes = full.numel() * full.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full.detach()))
        size += nbytes
    if bucket:
        yield bucket


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in backward (non-reentrant). transformers names the switch
    `activation_checkpointing_enable` since 5.2x and `gradient_checkpointing_enable` before (5.17, the floor)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
