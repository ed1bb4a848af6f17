"""A model as FSDP2 shards it: read on every rank, LoRA adapters added, split by the tensor-parallel plan over
the mesh's "tp" axis where it has one, its experts split over an expert mesh's "ep" axis where it has one (and
sharded over that mesh's "dp"), each transformer block and then the whole model passed to `fully_shard` over the
data-parallel axis; full tensors gathered back in buckets; gradients clipped across the meshes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from verst.config.schema import LoraConfig, ModelConfig
from verst.models.native import load_causal_lm
from verst.trainer import lora as lora_mod
from verst.trainer.critic import add_value_head
from verst.trainer.expert_parallel import parallelize_experts
from verst.trainer.tensor_parallel import parallelize
from verst.types import WeightBucket

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_sharded(path: str, model_cfg: ModelConfig, mesh: DeviceMesh, *, trainable: bool, value_head: bool = False,
                  gradient_checkpointing: bool = False, lora: LoraConfig | None = None,
                  adapters: dict[str, LoraConfig] | None = None,
                  experts_mesh: DeviceMesh | None = None, sequence_parallel: bool = False) -> torch.nn.Module:
    """The model at `path`, sharded over `mesh`. Every rank reads the checkpoint and keeps only its shard after
    fully_shard. Parameters are float32 master weights whatever the compute dtype (`model_cfg.dtype`). `impl`
    auto on CUDA keeps transformers' model, whose flash attention takes packed sequences; on CPU the native one
    skips transformers' import. `value_head`: PPO's critic; `lora`: adapters on it (the base frozen). A mesh
    with dims ("dp", "tp") applies the tensor-parallel plan over "tp" first (`verst.trainer.tensor_parallel`);
    `experts_mesh` ("dp", "ep") splits the MoE experts over "ep" (`verst.trainer.expert_parallel`);
    `sequence_parallel` splits the residual stream over "tp" too."""
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
        parallelize(model, mesh["tp"], sequence_parallel)
        mesh = mesh["dp"]
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[model_cfg.dtype], reduce_dtype=torch.float32)
    if experts_mesh is not None:
        for experts in parallelize_experts(model, experts_mesh["ep"]):
            fully_shard(experts, mesh=experts_mesh["dp"], mp_policy=policy)
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


def clip_grad_norm_across_meshes(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` for parameters on several meshes (e.g. "dp", and "dp" x "tp"), whose DTensors
    torch's total norm cannot stack. Collective (one all-reduce): each rank's squared local shards, a shard held
    by c ranks (the world over the sizes of the mesh axes that split it) counted 1/c times on each."""
    grads = [p.grad for p in params if p.grad is not None]
    world = dist.get_world_size()
    squares = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for grad in grads:
        local, splits = grad, 1
        if isinstance(grad, DTensor):
            local = grad.to_local()
            # axes that split it: Shard, or the strided shard FSDP2 lays over a tensor- or expert-parallel Shard(0)
            splits = math.prod(size for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True)
                               if not placement.is_replicate())
        squares += local.float().pow(2).sum() * (splits / world)
    dist.all_reduce(squares)
    norm = squares.sqrt()
    scale = min(1.0, max_norm / (float(norm) + 1e-6))  # clip_grads_with_norm_'s coefficient
    if scale < 1.0:
        for grad in grads:
            grad.mul_(scale)
    return norm
