"""Expert parallelism for transformers' Qwen3-MoE: each rank of an expert-parallel group holds a contiguous
slice of every MoE layer's experts, and the group's tokens travel to the rank of their expert and back by
all-to-all (autograd through torch's functional `all_to_all_single_autograd`).

The ranks of a group are data-parallel ranks: each runs its own micro-batches and routes them itself (routing
replay's hooks sit on the router, before dispatch). The experts' weights are DTensors `Shard(0)` over "ep",
which FSDP2 shards again over the mesh's "dp" axis; every other parameter is sharded by FSDP2 over all ranks.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from verst.trainer.distributed import data_by

# Model class -> the class of its MoE layers' experts (3-D `gate_up_proj` [experts, 2 x inter, hidden] and
# `down_proj` [experts, hidden, inter], called as experts(hidden [tokens, hidden], top_k_index, top_k_weights)).
EXPERT_PLANS = {"Qwen3MoeForCausalLM": "Qwen3MoeExperts"}


def expert_mesh(device_type: str, world_size: int, ep: int, tp: int) -> DeviceMesh | None:
    """[dp, ep] named ("dp", "ep"): an expert-parallel group holds `ep` consecutive ranks; "dp" is the axis
    FSDP2 shards the experts over. None without expert parallelism."""
    if ep == 1:
        return None
    if tp > 1:
        raise ValueError(f"trainer.expert_parallel_size = {ep} cannot combine with trainer.tensor_parallel_size = {tp}")
    return data_by("ep", ep, "trainer.expert_parallel_size", device_type, world_size)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `factor` backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:  # noqa: D102
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad * ctx.factor, None


class ExpertParallelExperts(torch.nn.Module):
    """A Qwen3-MoE experts module whose weights are split over the "ep" ranks (the same parameter names, so
    checkpoints, weight sync and exports see the model's own layout)."""

    def __init__(self, experts: torch.nn.Module, ep_mesh: DeviceMesh):
        super().__init__()
        self.num_experts, self.ep = experts.num_experts, ep_mesh.size()
        self.local_experts = self.num_experts // self.ep
        self.act_fn, self.group = experts.act_fn, ep_mesh.get_group()
        # every rank read the same checkpoint: each keeps its slice of the experts
        self.gate_up_proj = torch.nn.Parameter(distribute_tensor(experts.gate_up_proj.data, ep_mesh, [Shard(0)]))
        self.down_proj = torch.nn.Parameter(distribute_tensor(experts.down_proj.data, ep_mesh, [Shard(0)]))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [tokens, hidden], top_k_index and top_k_weights [tokens, top_k] -> [tokens, hidden]: each
        expert's output weighted and summed over the token's top-k on the token's own rank."""
        tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # [tokens x top_k]
        by_expert = torch.argsort(flat, stable=True)
        sent_per_expert = torch.bincount(flat, minlength=self.num_experts)  # [experts]
        routed = hidden[by_expert // top_k]  # [tokens x top_k, hidden], grouped by expert, so by rank
        out = torch.empty_like(routed)
        out[by_expert] = self._dispatch_and_combine(routed, sent_per_expert)
        return (out.view(tokens, top_k, -1) * top_k_weights[..., None]).sum(1)

    def _dispatch_and_combine(self, routed: torch.Tensor, sent_per_expert: torch.Tensor) -> torch.Tensor:
        """`routed` rows (grouped by expert) sent to their experts' ranks, run there, and sent back."""
        received_per_expert = all_to_all_single(sent_per_expert, None, None, self.group)  # [ep x local]: by source
        send = sent_per_expert.view(self.ep, self.local_experts).sum(1).tolist()
        receive = received_per_expert.view(self.ep, self.local_experts).sum(1).tolist()
        received = all_to_all_single_autograd(routed, receive, send, self.group)  # [received, hidden]
        # rows arrive by source rank, then local expert: grouped by local expert for the matmuls and back
        local_expert = torch.arange(self.local_experts, device=routed.device).repeat(self.ep)
        by_local = torch.argsort(torch.repeat_interleave(local_expert, received_per_expert), stable=True)
        outputs = torch.empty_like(received)
        outputs[by_local] = self._run_local(received[by_local], received_per_expert.view(self.ep, -1).sum(0))
        return all_to_all_single_autograd(outputs, send, receive, self.group)

    def _run_local(self, grouped: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """This rank's experts on `grouped` rows [rows, hidden] (per_expert [local] rows each, in order)."""
        # Each expert's gradient sums its tokens from the whole "ep" group, and FSDP2 then averages over "dp"
        # only: 1/ep makes it the average over every rank the backend's loss scaling assumes.
        gate_up = ScaleGrad.apply(_local(self.gate_up_proj), 1.0 / self.ep)  # [local, 2 x inter, hidden]
        down = ScaleGrad.apply(_local(self.down_proj), 1.0 / self.ep)  # [local, hidden, inter]
        outputs = []
        for expert, rows in enumerate(grouped.split(per_expert.tolist())):
            gate, up = torch.nn.functional.linear(rows, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(torch.nn.functional.linear(self.act_fn(gate) * up, down[expert]))
        return torch.cat(outputs)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def check_plan(model: torch.nn.Module, ep: int) -> None:
    """`model` is a class of `EXPERT_PLANS` whose experts `ep` divides; the message names the class or count."""
    name = type(model).__name__
    if name not in EXPERT_PLANS:
        raise ValueError(f"trainer.expert_parallel_size = {ep} has a plan for {sorted(EXPERT_PLANS)}, not {name}")
    experts = model.config.num_experts
    if experts % ep:
        raise ValueError(f"trainer.expert_parallel_size = {ep} does not divide the model's num_experts = {experts}")


def parallelize_experts(model: torch.nn.Module, ep_mesh: DeviceMesh) -> list[ExpertParallelExperts]:
    """Every MoE layer's experts of `model` replaced, in place, by their share over `ep_mesh`; returns the new
    modules (FSDP2 shards each over "dp")."""
    check_plan(model, ep_mesh.size())
    replaced = []
    for parent in list(model.modules()):
        child = getattr(parent, "experts", None)
        if type(child).__name__ == EXPERT_PLANS[type(model).__name__]:
            parent.experts = ExpertParallelExperts(child, ep_mesh)
            replaced.append(parent.experts)
    return replaced
