"""Context parallelism's layout (`verst.models.context_parallel.ContextShard`), without a process group: the ranks'
chunks cover a row once, balance the causal work, and each rank's attention mask is the whole row's mask at its
queries and the gathered keys; a batch is widened to whole chunks with padding nothing attends to."""

import pytest
import torch

from verst.models.context_parallel import ContextShard
from verst.models.native import sequence_mask
from verst.trainer.batching import collate
from verst.trainer.context_parallel import pad_to_chunks
from verst.trainer.items import TrainItem


def shard(rank: int, size: int) -> ContextShard:
    return ContextShard(group=None, rank=rank, size=size)


def test_each_rank_holds_a_chunk_from_each_end_and_the_ranks_cover_the_row_once():
    assert shard(0, 2).columns(8).tolist() == [0, 1, 6, 7]
    assert shard(1, 2).columns(8).tolist() == [2, 3, 4, 5]
    for size in (2, 3, 4):
        width = 4 * size
        assert sorted(shard(0, size).gathered_columns(width).tolist()) == list(range(width))
        # causal work: the keys each rank's queries see, equal over the ranks
        work = {int((shard(r, size).columns(width) + 1).sum()) for r in range(size)}
        assert len(work) == 1
    with pytest.raises(ValueError, match="width 6 is not a multiple of 2 x 2"):
        shard(0, 2).columns(6)


def test_a_ranks_mask_is_the_whole_rows_at_its_queries_and_the_gathered_keys():
    # a packed row: documents of 5 and 7 tokens, then 4 positions of padding (restarting)
    positions = torch.cat((torch.arange(5), torch.arange(7), torch.arange(4)))[None]
    whole = sequence_mask(positions)  # [1, 1, 16, 16]
    for rank in range(2):
        part = shard(rank, 2)
        rows, keys = part.columns(16), part.gathered_columns(16)
        assert torch.equal(sequence_mask(positions, part), whole[:, :, rows][:, :, :, keys])
    # one sequence filling the row: no mask without a shard, the causal one at the shard's places with it
    plain = torch.arange(16)[None]
    assert sequence_mask(plain) is None
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    part = shard(1, 2)
    assert torch.equal(sequence_mask(plain, part)[0, 0], causal[part.columns(16)][:, part.gathered_columns(16)])


def test_a_batch_is_widened_to_whole_chunks_with_a_padding_segment():
    items = [TrainItem(torch.arange(1, 8), 3, torch.ones(3), {}, 0), TrainItem(torch.arange(1, 5), 2, torch.ones(2), {}, 1)]
    batch = collate(items, [0, 1], packed=True)  # one row of 11 tokens
    padded = pad_to_chunks(batch, 2)
    assert padded.input_ids.shape == (1, 12)
    assert padded.input_ids[0, 11] == 0 and padded.position_ids[0, 11] == 0 and not padded.logits_to_keep[0, 11]
    assert torch.equal(padded.input_ids[:, :11], batch.input_ids) and torch.equal(padded.targets, batch.targets)
    mask = sequence_mask(padded.position_ids)[0, 0]
    assert not mask[:11, 11].any()  # no token of a sequence attends to the padding
    assert pad_to_chunks(padded, 2) is padded
