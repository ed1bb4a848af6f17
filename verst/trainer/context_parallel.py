"""Context parallelism in the trainer: the ranks of a context-parallel group see the same micro-batches and each
computes its share of every row's positions in verst's native model (`verst.models.context_parallel`); the
per-token logprobs and entropy are gathered back into the rows' own order, so the loss fn sees whole sequences.

Every rank of a group then computes the same loss; the gather's backward sums the group's gradients of it onto
each rank's positions (C times one rank's), and FSDP2 averages over all ranks (data- and context-parallel, one
flattened axis), so the backend scales the loss by the data-parallel size to get the global batch's gradient.
"""

from __future__ import annotations

import dataclasses

import torch

from verst.config.schema import ModelConfig
from verst.models.context_parallel import ContextShard
from verst.trainer.batching import MicroBatch
from verst.trainer.distributed import data_by
from verst.trainer.tensor_parallel import logprobs_and_entropy


def context_shard(device_type: str, world_size: int, cp: int, tp: int) -> ContextShard | None:
    """This rank's place in [dp, cp] named ("dp", "cp"): a context-parallel group holds `cp` consecutive ranks.
    None without context parallelism."""
    if cp == 1:
        return None
    if tp > 1:
        raise ValueError(f"trainer.context_parallel_size = {cp} cannot combine with trainer.tensor_parallel_size = {tp}")
    mesh = data_by("cp", cp, "trainer.context_parallel_size", device_type, world_size)
    return ContextShard(mesh["cp"].get_group(), mesh.get_local_rank("cp"), cp)


def native_model(model: ModelConfig, cp: int) -> ModelConfig:
    """`model` loaded as verst's native model, whose attention splits the rows (auto would take transformers'
    on CUDA); `model.impl = "transformers"` refused."""
    if model.impl == "transformers":
        raise ValueError(f"trainer.context_parallel_size = {cp} runs in verst's native model, not model.impl = "
                         "'transformers'")
    return model.model_copy(update={"impl": "native"})


def pad_to_chunks(batch: MicroBatch, size: int) -> MicroBatch:
    """`batch` with its rows widened to a multiple of 2 x `size` chunks: the new positions are one more padding
    segment (id 0, positions from 0, no logits kept), which no token of a sequence attends to."""
    width = batch.input_ids.shape[1]
    extra = -width % (2 * size)
    if not extra:
        return batch
    rows = batch.input_ids.shape[0]
    padding = torch.arange(extra, device=batch.position_ids.device).expand(rows, extra)
    return dataclasses.replace(
        batch,
        input_ids=torch.cat((batch.input_ids, batch.input_ids.new_zeros(rows, extra)), dim=1),
        position_ids=torch.cat((batch.position_ids, padding), dim=1),
        logits_to_keep=torch.cat((batch.logits_to_keep, batch.logits_to_keep.new_zeros(rows, extra)), dim=1),
    )


def sharded_logprobs(model: torch.nn.Module, batch: MicroBatch, shard: ContextShard, temperature: float,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target) [n_resp_tokens] and, if asked, the entropy, in `batch.targets`' order, from this rank's share
    of the positions (`batch` padded by `pad_to_chunks`; collective over the group, autograd)."""
    keep = batch.logits_to_keep  # [rows, width]
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, logits_to_keep=keep,
                   context_shard=shard, use_cache=False).logits  # [this rank's kept, vocab]
    targets = torch.zeros_like(batch.input_ids)
    targets[keep] = batch.targets  # row-major, as collate lists them
    local_keep = shard.take(keep)  # [rows, width / size]
    chosen, entropy = logprobs_and_entropy(logits, shard.take(targets)[local_keep], temperature, with_entropy)

    def whole(values: torch.Tensor) -> torch.Tensor:
        local = values.new_zeros(local_keep.shape).index_put((local_keep,), values)
        return shard.restore(local)[keep]

    return whole(chosen), whole(entropy) if entropy is not None else None
