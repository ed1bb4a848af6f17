"""Sequence parallelism's layout in verst's native model (Megatron's, under tensor parallelism): between the
tensor-parallel regions each rank of a group holds `1 / size` of every row's positions, contiguous.

The vocabulary-parallel embedding's partial rows are reduce-scattered onto the rank's share (transformers' model:
looked up whole and split, `SequenceShard.split`); the norms run on the share; the final norm's output is gathered
whole for the LM head. Entering and leaving attention and the MLP (all-gather in, reduce-scatter out) is the
tensor-parallel plan's (`verst.trainer.tensor_parallel`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclasses.dataclass(frozen=True)
class SequenceShard:
    """This rank's contiguous share of every row over the tensor-parallel group `mesh` (1-D)."""

    mesh: DeviceMesh

    def pad(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` and `positions` [batch, width] widened to a multiple of the group's size: token 0 at the positions
        after each row's last, which no earlier token attends to under the causal mask (their outputs are cut)."""
        extra = -rows.shape[1] % self.mesh.size()
        if not extra:
            return rows, positions
        after = positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)  # [batch, extra]
        return torch.cat((rows, rows.new_zeros(rows.shape[0], extra)), dim=1), torch.cat((positions, after), dim=1)

    def split(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's positions [batch, width / size, ...] of `whole` [batch, width, ...], the same on every rank
        of the group; backward all-gathers the shares' gradients into the whole's."""
        replicated = DTensor.from_local(whole, self.mesh, [Replicate()], run_check=False)
        return replicated.redistribute(self.mesh, [Shard(1)]).to_local()

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole rows [batch, width, ...] from every rank's `local` share (an all-gather); the gradient of the
        whole is the same on every rank (the head's is replicated or reduced over the group), so backward keeps
        this rank's part of it."""
        sharded = DTensor.from_local(local, self.mesh, [Shard(1)], run_check=False)
        return sharded.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Replicate()])
