"""Context parallelism's layout in verst's native model: the ranks of a group each hold a share of every row's
positions, and the keys and values of the whole row are gathered over the group in each attention layer.

The load-balanced layout (Megatron's and torchtitan's): a row of `width` positions is cut into 2 x size equal
chunks, and rank r holds chunks r and 2 x size - 1 - r, so under a causal mask every rank attends to about the
same number of keys. The gather is torch's autograd all-gather, whose backward reduce-scatters (sums) the
gathered keys' and values' gradients onto the ranks that computed them (the all-gather-KV form of Llama 3's paper).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

try:
    from torch.distributed._functional_collectives import all_gather_single_autograd
except ImportError:  # torch < 2.13 (2.11 is the floor): the same collective under its earlier name
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as all_gather_single_autograd


@dataclasses.dataclass(frozen=True)
class ContextShard:
    """This rank's share of every row: `rank` of a context-parallel group of `size` ranks (`group`)."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def columns(self, width: int, rank: int | None = None) -> torch.Tensor:
        """The row positions [width / size] that `rank` (default this one) holds: chunks rank and
        2 x size - 1 - rank of the row cut into 2 x size."""
        if width % (2 * self.size):
            raise ValueError(f"a context-parallel row's width {width} is not a multiple of 2 x {self.size}")
        chunk, r = width // (2 * self.size), self.rank if rank is None else rank
        return torch.cat((torch.arange(r * chunk, (r + 1) * chunk),
                          torch.arange((2 * self.size - 1 - r) * chunk, (2 * self.size - r) * chunk)))

    def gathered_columns(self, width: int) -> torch.Tensor:
        """The row positions [width] of what `gather` returns: each rank's columns, ranks in order."""
        return torch.cat([self.columns(width, rank) for rank in range(self.size)])

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's positions of `rows` [batch, width, ...]: [batch, width / size, ...]."""
        return rows[:, self.columns(rows.shape[1]).to(rows.device)]

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `local` concatenated along `dim` in rank order (`gathered_columns`); the backward sums each
        rank's gradient of the whole over the group and hands every rank its own part (a reduce-scatter)."""
        return all_gather_single_autograd(local.contiguous(), gather_dim=dim, group=self.group)

    def restore(self, local: torch.Tensor) -> torch.Tensor:
        """The whole rows [batch, width, ...] in their own order from every rank's `local` [batch, width / size, ...]
        (collective, autograd)."""
        gathered = self.gather(local, dim=1)
        order = torch.argsort(self.gathered_columns(gathered.shape[1])).to(local.device)
        return gathered[:, order]
