"""The RL train step over a real 1-rank backend: on-policy invariants and metric wiring."""

import random

import pytest
import torch

from verst.config import load_config
from verst.recipes.common import open_trainer
from verst.recipes.rl_steps import train_on_groups
from verst.types import Sample, Status


def make_groups(n_groups: int, n: int, seed: int = 0) -> list[list[Sample]]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(0, 256) for _ in range(5)]
        group = []
        for i in range(n):
            resp = [rng.randrange(0, 256) for _ in range(rng.randint(1, 6))]
            group.append(Sample(tokens=prompt + resp, response_length=len(resp), loss_mask=[1] * len(resp),
                                rollout_logprobs=[0.0] * len(resp), reward=float(rng.random() < 0.5),
                                status=Status.COMPLETED, weight_versions=["0"], group_index=g, index=g * n + i))
        groups.append(group)
    return groups


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_first_step_is_on_policy_and_updates(tiny_model_dir, estimator):
    cfg = load_config(None, ["--model.path", str(tiny_model_dir), "--trainer.lr", "1e-3",
                             "--algorithm.advantage-estimator", estimator, "--algorithm.entropy-coef", "0.01"])
    groups = make_groups(4, 4)
    with open_trainer(cfg, total_steps=2) as trainer:
        samples = [s for g in groups for s in g]
        for s, lp in zip(samples, trainer.logprobs(samples)):  # the engine would report these
            s.rollout_logprobs = lp.tolist()
        before = {n: t.clone() for b in trainer.named_weights(1 << 30) for n, t in b}
        metrics = train_on_groups(trainer, groups, cfg)
        after = {n: t for b in trainer.named_weights(1 << 30) for n, t in b}
    assert metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["train/pg_clipfrac"] == 0.0
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert metrics["train/entropy"] > 0 and metrics["train/grad_norm"] > 0
    assert metrics["train/advantage_abs_mean"] > 0
    assert any(not torch.equal(before[n], after[n]) for n in before)
