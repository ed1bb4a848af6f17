"""Trainer batching, items, loss and lr schedule: pure functions, no model."""

import math

import pytest
import torch

from verst.config.schema import TrainerConfig
from verst.trainer import TrainItem, TrainItemError, as_items, count_policy_sequences, count_policy_tokens, make_items
from verst.trainer.batching import (
    ForwardOutputs,
    balance_across_ranks,
    collate,
    dummy_micro_batch,
    pack_micro_batches,
    split_to_count,
)
from verst.trainer.losses import combine_metric, sft_loss_fn
from verst.trainer.optim import lr_factor
from verst.types import Sample, Status


def item(prompt: int, response: int, index: int = 0, **extras) -> TrainItem:
    tokens = torch.arange(prompt + response) + 10 * index
    return TrainItem(tokens, response, torch.ones(response), extras, index)


def sample(prompt: int, response: int, index: int) -> Sample:
    return Sample(
        tokens=list(range(prompt + response)), response_length=response, loss_mask=[1] * response,
        rollout_logprobs=[-0.5] * response, status=Status.COMPLETED, index=index,
    )


# ---- items -------------------------------------------------------------------------------------
def test_item_from_sample_carries_rollout_logprobs_and_broadcasts_scalars():
    items = make_items([sample(3, 2, 0), sample(4, 3, 1)], advantages=[1.5, -0.5])
    assert items[1].extras["rollout_logprobs"].tolist() == [-0.5] * 3
    assert items[1].extras["advantages"].tolist() == [-0.5] * 3
    assert items[0].prompt_length == 3 and items[1].index == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokens=[1, 2, 3], response_length=3, loss_mask=[1, 1, 1]), "at least one prompt token"),
        (dict(tokens=[1, 2, 3], response_length=2, loss_mask=[1]), "loss_mask has shape (1,), expected (2,)"),
        (dict(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], extras={"adv": [1.0]}), "extra 'adv'"),
    ],
)
def test_item_invariants_name_the_offending_values(kwargs, message):
    with pytest.raises(TrainItemError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainItem(**kwargs)


def test_as_items_renumbers_and_rejects_mismatched_extras():
    items = as_items([item(2, 2, index=7), item(3, 1, index=7)])
    assert [it.index for it in items] == [0, 1]
    assert set(as_items([sample(2, 1, 3)])[0].extras) == {"rollout_logprobs"}
    with pytest.raises(TrainItemError, match="same extras"):
        as_items([item(2, 2), item(2, 2, adv=1.0)])
    with pytest.raises(TrainItemError, match="empty"):
        as_items([])
    with pytest.raises(TrainItemError, match="extra 'adv' has 1 values for 2 samples"):
        make_items([sample(2, 1, 0), sample(2, 1, 1)], adv=[1.0])


# ---- rank balance and micro-batches --------------------------------------------------------------
def test_balance_across_ranks_covers_every_item_once_with_even_tokens():
    lengths = [50, 10, 40, 30, 30, 20, 5, 15]
    shares = balance_across_ranks(lengths, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= 10
    assert shares == balance_across_ranks(lengths, 2)  # deterministic on every rank


@pytest.mark.parametrize("packed", [False, True])
def test_micro_batches_respect_the_token_budget(packed):
    lengths = [9, 3, 7, 7, 2, 5, 8, 1]
    bins = pack_micro_batches(list(range(len(lengths))), lengths, 16, packed)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        cost = sum(lengths[i] for i in b) if packed else len(b) * max(lengths[i] for i in b)
        assert cost <= 16
    with pytest.raises(ValueError, match="train item 0 has 9 tokens, more than trainer.max_tokens_per_micro_batch = 8"):
        pack_micro_batches([0, 1], lengths, 8, packed)


def test_padded_micro_batches_keep_short_rows_away_from_long_ones():
    """Long-tailed lengths: no row is padded past twice its length, and the budget alone would have put all
    of them in one micro-batch (every row padded to 134)."""
    lengths = [134, 134] + [38] * 6 + [10] * 24
    bins = pack_micro_batches(list(range(len(lengths))), lengths, 8192, packed=False)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert [sorted({lengths[i] for i in b}) for b in bins] == [[134], [38], [10]]
    assert sum(len(b) * max(lengths[i] for i in b) for b in bins) == 2 * 134 + 6 * 38 + 24 * 10  # no padding
    mixed = pack_micro_batches([0, 1, 2], [20, 11, 10], 8192, packed=False)
    assert mixed == [[0, 1, 2]]  # within twice their length, rows share a micro-batch
    packed = pack_micro_batches(list(range(len(lengths))), lengths, 8192, packed=True)
    assert len(packed) == 1  # packed rows carry no padding: only the budget splits them


def test_split_to_count_halves_then_adds_empty_micro_batches():
    assert split_to_count([[0, 1, 2, 3], [4]], 3) == [[4], [0, 2], [1, 3]]
    grown = split_to_count([[0]], 3)
    assert grown == [[0], [], []]
    with pytest.raises(ValueError, match="cannot shrink"):
        split_to_count([[0], [1]], 1)


@pytest.mark.parametrize("packed", [False, True])
def test_collate_layout_positions_targets_and_padding(packed):
    items = [item(3, 2, 0, adv=1.0), item(2, 4, 1, adv=2.0), item(4, 1, 2, adv=3.0)]
    batch = collate(items, [0, 1, 2], packed)
    rows = 1 if packed else 3
    assert batch.input_ids.shape[0] == rows and batch.position_ids.shape == batch.input_ids.shape
    # Position ids restart at 0 for each sequence (and for the trailing padding segment).
    if packed:
        assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    else:
        assert batch.position_ids[1].tolist() == [0, 1, 2, 3, 4, 5]
        assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0]
    # The kept positions predict exactly the response tokens, in item order.
    expected = torch.cat([it.tokens[it.prompt_length :] for it in items])
    assert torch.equal(batch.targets, expected)
    next_tokens = batch.input_ids.roll(-1, dims=1)[batch.logits_to_keep]
    assert torch.equal(next_tokens, expected)
    assert batch.loss_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert batch["adv"].tolist() == [[1, 1, 0, 0], [2, 2, 2, 2], [3, 0, 0, 0]]
    padded = batch.pad_responses(torch.arange(7.0))
    assert padded.tolist() == [[0, 1, 0, 0], [2, 3, 4, 5], [6, 0, 0, 0]]
    with pytest.raises(KeyError, match="no extra 'old_logprobs'"):
        batch["old_logprobs"]


def test_dummy_micro_batch_has_no_policy_tokens():
    batch = dummy_micro_batch(item(3, 2, adv=1.0))
    assert batch.indices == [] and batch.loss_mask.sum() == 0 and set(batch.extras) == {"adv"}


# ---- loss and normalisers -----------------------------------------------------------------------
def test_sft_loss_divides_by_the_global_normaliser():
    batch = collate([item(2, 2, 0), item(2, 3, 1)], [0, 1], packed=False)
    batch.loss_mask[1, 2] = 0.0
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -9.0]])
    loss, metrics = sft_loss_fn(ForwardOutputs(logprobs), batch, normalizer=8.0)
    assert loss.item() == pytest.approx(4.0 / 8.0)
    assert metrics["train/sft_loss"] == pytest.approx(4.0 / 4.0)  # metrics are local means
    assert count_policy_tokens(batch.loss_mask) == 4.0
    assert count_policy_sequences(torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])) == 2.0


# ---- learning-rate schedule ----------------------------------------------------------------------
def test_lr_schedules_warm_up_then_decay_to_the_floor():
    cosine = TrainerConfig(lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_factor(s, cosine, 12) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(7, cosine, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(12, cosine, 12) == pytest.approx(0.1) and lr_factor(50, cosine, 12) == pytest.approx(0.1)
    linear = TrainerConfig(lr_schedule="linear", min_lr_ratio=0.0)
    assert [lr_factor(s, linear, 4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_factor(100, TrainerConfig(), None) == 1.0
    with pytest.raises(ValueError, match="needs the total number of train steps"):
        lr_factor(3, linear, None)


def test_metrics_combine_as_weighted_means_except_extremes():
    totals: dict[str, float] = {}
    for metrics, weight in [({"train/x": 2.0, "train/r_max": 3.0, "train/r_min": 0.5}, 0.25),
                            ({"train/x": 4.0, "train/r_max": 1.0, "train/r_min": 0.7}, 0.75),
                            ({"train/x": 1.0}, 0.0)]:  # fmt: skip
        for key, value in metrics.items():
            combine_metric(totals, key, value, weight)
    assert totals == {"train/x": 2.0 * 0.25 + 4.0 * 0.75, "train/r_max": 3.0, "train/r_min": 0.5}
