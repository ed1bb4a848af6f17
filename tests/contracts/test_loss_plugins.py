"""The loss plug-ins (`algorithm.mismatch_fn`, `policy_loss_fn`, `loss_reducer`) through the train step's
loss fn (`rl_loss_fn` on a collated micro-batch, as the backend calls it): each is loaded by its import
path, called with the documented arguments, and its result is what the loss uses. The examples of
docs/plugins.md (examples/plugins/losses.py) go the same way, against loop references."""

from __future__ import annotations

import math

import pytest
import torch

from tests.contracts import loss_plugins
from verst.algo import aggregation_normalizer, load_loss_plugins
from verst.config import ConfigError, load_config
from verst.config.schema import AlgorithmConfig
from verst.trainer import ForwardOutputs, make_items
from verst.trainer.batching import collate
from verst.trainer.rl_steps import rl_loss_fn
from verst.types import Sample, Status

RESPONSES = [3, 1, 4]  # response lengths; sequence 2 has an environment token
MASKS = [[1, 1, 1], [1], [1, 1, 0, 1]]


def micro_batch(seed: int = 0):
    """A collated micro-batch of three samples and the forward's logprobs [3, 4] (leaf, float32)."""
    gen = torch.Generator().manual_seed(seed)
    samples, old, adv = [], [], []
    for i, (n, mask) in enumerate(zip(RESPONSES, MASKS)):
        rollout = (-torch.rand(n, generator=gen) * 2).tolist()
        samples.append(Sample(tokens=[5, 6] + list(range(10, 10 + n)), response_length=n, loss_mask=mask,
                              rollout_logprobs=rollout, reward=1.0, status=Status.COMPLETED, index=i))
        old.append(torch.tensor(rollout) + 0.3 * torch.randn(n, generator=gen))
        adv.append(torch.full((n,), [1.0, -0.5, 2.0][i]))
    items = make_items(samples, advantages=adv, old_logprobs=old)
    batch = collate(items, [0, 1, 2], packed=False)
    logprobs = batch["old_logprobs"] + 0.1 * torch.randn(batch.loss_mask.shape, generator=gen)
    return batch, logprobs.requires_grad_(True)


def run_loss(algo: AlgorithmConfig, seed: int = 0):
    batch, logprobs = micro_batch(seed)
    normalizer = aggregation_normalizer(algo.loss_aggregation, batch.loss_mask)
    loss, metrics = rl_loss_fn(algo, False, ForwardOutputs(logprobs=logprobs), batch, normalizer)
    loss.backward()
    return batch, logprobs, loss, metrics


def policy_tokens(batch):
    return [(i, t) for i in range(batch.loss_mask.shape[0]) for t in range(batch.loss_mask.shape[1])
            if batch.loss_mask[i, t]]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_calls():
    loss_plugins.CALLS.clear()


def test_each_plug_in_is_called_with_the_documented_arguments_and_its_result_is_the_loss():
    algo = AlgorithmConfig(mismatch_fn="tests.contracts.loss_plugins:half_weights",
                           policy_loss_fn="tests.contracts.loss_plugins:reinforce",
                           loss_reducer="tests.contracts.loss_plugins:doubled_mean",
                           tis_clip_low=0.25, tis_clip=3.0)  # fmt: skip
    batch, logprobs, loss, metrics = run_loss(algo)
    assert [name for name, _ in loss_plugins.CALLS] == ["mismatch_fn", "policy_loss_fn", "loss_reducer"]
    assert loss_plugins.CALLS[0][1] == {"shape": (3, 4), "clip_low": 0.25, "clip_high": 3.0}
    assert loss_plugins.CALLS[1][1] == {"shape": (3, 4), "eps_clip": 0.2}
    assert loss_plugins.CALLS[2][1] == {"aggregation": "token_mean"}
    tokens = policy_tokens(batch)
    # loss = 2 × token mean of 0.5 · (−A · log π): every plug-in's output is in it
    want = 2.0 * sum(0.5 * -batch["advantages"][i, t].item() * logprobs[i, t].item() for i, t in tokens) / len(tokens)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert metrics["train/tis_mean"] == pytest.approx(0.5) and metrics["train/mis_reject_frac"] == 0.0
    for i, t in tokens:  # d loss / d log π = 2 · 0.5 · (−A) / N
        assert logprobs.grad[i, t].item() == pytest.approx(-batch["advantages"][i, t].item() / len(tokens), rel=1e-6)


def test_the_documented_examples_run_through_the_loss():
    algo = AlgorithmConfig(mismatch_fn="examples.plugins.losses:truncate_high_mask_low",
                           policy_loss_fn="examples.plugins.losses:cispo",
                           loss_aggregation="seq_mean_token_sum",
                           loss_reducer="examples.plugins.losses:token_sum_over_budget",
                           tis_clip_low=0.8, tis_clip=1.2, eps_clip_high=0.05)  # fmt: skip
    batch, logprobs, loss, metrics = run_loss(algo, seed=1)
    old, rollout, adv = batch["old_logprobs"], batch["rollout_logprobs"], batch["advantages"]
    total, grads, rejected = 0.0, {}, 0
    for i, t in policy_tokens(batch):
        rho = math.exp(old[i, t].item() - rollout[i, t].item())
        weight = 0.0 if rho < 0.8 else min(rho, 1.2)  # truncate high, mask low
        rejected += rho < 0.8
        cispo_w = min(math.exp(logprobs[i, t].item() - old[i, t].item()), 1.05)
        total += weight * -cispo_w * adv[i, t].item() * logprobs[i, t].item()
        grads[i, t] = weight * -cispo_w * adv[i, t].item()
    budget = 1024 * 3  # three sequences, each over the generation budget
    assert loss.item() == pytest.approx(total / budget, rel=1e-5)
    for (i, t), g in grads.items():
        assert logprobs.grad[i, t].item() == pytest.approx(g / budget, rel=1e-5, abs=1e-9)
    assert 0 < rejected and "train/mis_reject_frac" in metrics


@pytest.mark.parametrize("field, path, message", [
    ("loss_reducer", "tests.contracts.no_such_module:fn", "algorithm.loss_reducer = 'tests.contracts.no_such_module:fn': "
     "cannot import module 'tests.contracts.no_such_module'"),
    ("mismatch_fn", "tests.contracts.loss_plugins:missing", "algorithm.mismatch_fn = "
     "'tests.contracts.loss_plugins:missing': module 'tests.contracts.loss_plugins' has no attribute 'missing'"),
    ("loss_reducer", "tests.contracts.loss_plugins:NotAFunction", "algorithm.loss_reducer = "
     "'tests.contracts.loss_plugins:NotAFunction' is a type, not a function"),
    ("loss_reducer", "tests.contracts.loss_plugins:async_reducer", "algorithm.loss_reducer = "
     "'tests.contracts.loss_plugins:async_reducer' is an async function"),
    ("loss_reducer", "tests.contracts.loss_plugins:two_args", "algorithm.loss_reducer = "
     "'tests.contracts.loss_plugins:two_args' cannot be called as `def fn(token_values, loss_mask, aggregation)"),
    ("policy_loss_fn", "tests.contracts.loss_plugins:half_weights", "algorithm.policy_loss_fn = "
     "'tests.contracts.loss_plugins:half_weights' cannot be called as"),
])  # fmt: skip
def test_a_bad_plug_in_fails_naming_the_field_and_the_path(field, path, message):
    with pytest.raises(ValueError) as error:
        load_loss_plugins(AlgorithmConfig(**{field: path}))
    assert message in str(error.value)


def test_a_plug_in_that_contradicts_a_built_in_is_refused_with_the_config():
    with pytest.raises(ConfigError, match="algorithm.mismatch_fn = 'm:f' replaces algorithm.mismatch_correction = 'tis'"):
        load_config(None, ["--algorithm.mismatch-fn", "m:f", "--algorithm.mismatch-correction", "tis"])
    with pytest.raises(ConfigError, match="cannot be combined with algorithm.old_logprobs = 'rollout'"):
        load_config(None, ["--algorithm.mismatch-fn", "m:f", "--algorithm.old-logprobs", "rollout"])
