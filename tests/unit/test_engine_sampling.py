"""Engine sampling: greedy, temperature, top-k/top-p/min-p truncation, seeds, and the reported logprobs."""

import pytest
import torch

from verst.engine.sampling import RowSampling, sample
from verst.inference_client.protocol import SamplingParams


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def row(position=0, banned=(), top_logprobs=0, **params):
    return RowSampling(SamplingParams(**params), position, banned, top_logprobs)


def test_greedy_picks_argmax_and_reports_raw_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    out = sample(logits.clone(), [row(temperature=0.0)] * 2, _gen())
    assert out.tokens == [1, 0]
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([expected[0, 1].item(), expected[1, 0].item()], abs=1e-6)


def test_logprob_is_of_the_temperature_scaled_distribution():
    logits = torch.randn(4, 50, generator=_gen(1))
    rows = [row(temperature=t) for t in (0.5, 1.0, 2.0, 1.0)]
    out = sample(logits.clone(), rows, _gen(2))
    for i, (one, tok) in enumerate(zip(rows, out.tokens)):
        expected = torch.log_softmax(logits[i] / one.params.temperature, -1)[tok].item()
        assert out.logprobs[i] == pytest.approx(expected, abs=1e-5)


def test_top_k_and_top_p_and_min_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]]).repeat(300, 1)
    top_k = sample(logits.clone(), [row(top_k=2)] * 300, _gen(3)).tokens
    assert set(top_k) == {0, 1}
    # probabilities ~ [0.66, 0.24, 0.09, ...]: top_p 0.8 keeps the first two tokens only
    top_p = sample(logits.clone(), [row(top_p=0.8)] * 300, _gen(4)).tokens
    assert set(top_p) == {0, 1}
    min_p = sample(logits.clone(), [row(min_p=0.2)] * 300, _gen(5)).tokens
    assert set(min_p) == {0, 1}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    tokens = torch.tensor(sample(logits, [row()] * 4000, _gen(6)).tokens)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_seeded_rows_repeat_whatever_shares_the_batch():
    logits = torch.randn(3, 40, generator=_gen(7))
    alone = sample(logits[1:2].clone(), [row(sampling_seed=11, position=4)], _gen(8)).tokens
    batched = sample(
        logits.clone(), [row(), row(sampling_seed=11, position=4), row(sampling_seed=3)], _gen(9)
    ).tokens
    assert batched[1] == alone[0]
    draws = {sample(logits[1:2].clone(), [row(sampling_seed=11, position=p)], _gen()).tokens[0] for p in range(30)}
    assert len(draws) > 1  # the position changes the draw


def test_banned_tokens_are_never_sampled_and_top_logprobs_are_sorted():
    logits = torch.tensor([[9.0, 1.0, 0.5, 0.1]])
    out = sample(logits.clone(), [row(temperature=0.0, banned=(0,), top_logprobs=3)], _gen())
    assert out.tokens == [1]
    values = [lp for lp, _ in out.top[0]]
    assert values == sorted(values, reverse=True) and [t for _, t in out.top[0]][0] == 1


def test_mismatched_rows_fail_loudly():
    with pytest.raises(ValueError, match="2 logit rows but 1"):
        sample(torch.zeros(2, 3), [row()], _gen())
