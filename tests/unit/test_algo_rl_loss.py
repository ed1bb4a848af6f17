"""The combined rl_loss: composition vs a loop reference, micro-batch additivity, loud failures."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_algo_policy_loss import MASK, ref_aggregate, ref_ppo_token
from verst.algo import aggregation_normalizer, rl_loss, sft_loss
from verst.config.schema import AlgorithmConfig


def inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(MASK.shape, generator=gen, dtype=torch.float64)

    old = -torch.rand(MASK.shape, generator=gen, dtype=torch.float64) * 3
    return {
        "logprobs": (old + rand(0.3)).requires_grad_(True),
        "old_logprobs": old,
        "advantages": rand() * MASK,
        "rollout_logprobs": old + rand(0.4),
        "ref_logprobs": old + rand(0.5),
        "entropy": torch.rand(MASK.shape, generator=gen, dtype=torch.float64).requires_grad_(True),
        "teacher_logprobs": old + rand(0.5),
        "values": rand().requires_grad_(True),
        "old_values": rand(),
        "returns": rand(),
    }


FULL_CFG = dict(
    eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0, mismatch_correction="tis", tis_clip_low=0.5, tis_clip=1.5,
    kl_loss_coef=0.1, kl_estimator="k3", entropy_coef=0.01, distill_coef=0.5, reward_coef=0.8,
    value_clip=0.2,
)  # fmt: skip


def reference(x: dict[str, torch.Tensor], mode: str) -> dict[str, float]:
    """Every term of rl_loss written per token with math, then reduced by loops."""
    lists = {k: v.tolist() for k, v in x.items()}
    per_token_mode = "seq_mean_token_mean" if mode == "seq_mean_token_sum" else mode
    names = ("pg", "clip", "kl", "ent", "dist_kl", "v", "tis", "tisc", "rho", "rho2")
    rows: dict[str, list[list[float]]] = {k: [] for k in names}
    for i in range(MASK.shape[0]):
        for row in rows.values():
            row.append([])
        for t in range(MASK.shape[1]):
            g = {k: v[i][t] for k, v in lists.items()}
            # on-policy distillation: the teacher's minus the old policy's logprob, added to the scaled task advantage
            advantage = 0.8 * g["advantages"] + 0.5 * (g["teacher_logprobs"] - g["old_logprobs"])
            pg, clipped = ref_ppo_token(g["logprobs"], g["old_logprobs"], advantage, 0.2, 0.28, 3.0)
            rho = math.exp(g["old_logprobs"] - g["rollout_logprobs"])
            tis = min(max(rho, 0.5), 1.5)
            log_r = g["ref_logprobs"] - g["logprobs"]
            vc = g["old_values"] + min(max(g["values"] - g["old_values"], -0.2), 0.2)
            distill_kl = g["logprobs"] - g["teacher_logprobs"]
            values = {
                "pg": pg * tis, "clip": float(clipped), "kl": math.exp(log_r) - 1 - log_r, "ent": g["entropy"],
                "dist_kl": distill_kl,
                "v": 0.5 * max((g["values"] - g["returns"]) ** 2, (vc - g["returns"]) ** 2),
                "tis": tis, "tisc": float(rho < 0.5 or rho > 1.5), "rho": rho, "rho2": rho * rho,
            }  # fmt: skip
            for k, v in values.items():
                rows[k][-1].append(v)
    mask = MASK.tolist()
    agg = {k: ref_aggregate(v, mask, mode) for k, v in rows.items()}
    per_tok = {k: ref_aggregate(v, mask, per_token_mode) for k, v in rows.items()}
    loss = agg["pg"] + 0.1 * agg["kl"] - 0.01 * agg["ent"] + agg["v"]
    return {
        "train/loss": loss, "train/pg_loss": agg["pg"], "train/pg_clipfrac": per_tok["clip"], "train/kl": per_tok["kl"],
        "train/entropy": per_tok["ent"], "train/distill_kl": per_tok["dist_kl"], "train/value_loss": agg["v"],
        "train/tis_mean": per_tok["tis"], "train/tis_clipfrac": per_tok["tisc"],
        "train/mismatch_ratio_mean": per_tok["rho"], "train/mismatch_ratio_sq_mean": per_tok["rho2"],
        "train/mismatch_ratio_max": max(r for row, m_row in zip(rows["rho"], mask) for r, m in zip(row, m_row) if m),
        "train/mismatch_ratio_min": min(r for row, m_row in zip(rows["rho"], mask) for r, m in zip(row, m_row) if m),
    }  # fmt: skip


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_rl_loss_composes_every_term_like_the_reference(mode):
    x = inputs(0)
    cfg = AlgorithmConfig(loss_aggregation=mode, **FULL_CFG)
    loss, metrics = rl_loss(cfg, x.pop("logprobs"), x.pop("old_logprobs"), x.pop("advantages"), MASK, **x)
    want = reference(inputs(0), mode)
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, rel=1e-10), key
    assert loss.item() == pytest.approx(want["train/loss"], rel=1e-10)
    assert all(type(v) is float for v in metrics.values())
    expected_keys = set(want) | {"train/ppo_kl", "train/value_clipfrac", "train/rollout_logprob_abs_diff",
                                 "train/rollout_kl"}  # fmt: skip
    assert set(metrics) == expected_keys


def test_entropy_and_value_gradients_flow_where_they_should():
    x = inputs(1)
    entropy, values, logp = x["entropy"], x["values"], x["logprobs"]
    cfg = AlgorithmConfig(entropy_coef=0.01)
    loss, _ = rl_loss(cfg, logp, x["old_logprobs"], x["advantages"], MASK, entropy=entropy, values=values,
                      old_values=x["old_values"], returns=x["returns"])  # fmt: skip
    loss.backward()
    n = MASK.sum().item()
    torch.testing.assert_close(entropy.grad, -0.01 * MASK / n)
    assert torch.all(values.grad[MASK == 0] == 0) and values.grad[MASK == 1].abs().sum() > 0
    assert torch.all(logp.grad[MASK == 0] == 0)


def call(cfg: AlgorithmConfig, x: dict[str, torch.Tensor], rows: slice, normalizer: float | None = None):
    part = {k: v[rows] for k, v in x.items()}
    return rl_loss(cfg, part.pop("logprobs"), part.pop("old_logprobs"), part.pop("advantages"), MASK[rows],
                   normalizer=normalizer, **part)  # fmt: skip


LEAVES = ("logprobs", "entropy", "values")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("policy,correction", [("ppo_clip", "tis"), ("gspo", "mis_sequence"), ("ppo_clip", "icepop")])
def test_micro_batches_with_the_global_normalizer_add_up_to_the_full_batch(mode, policy, correction):
    cfg = AlgorithmConfig(**{**FULL_CFG, "loss_aggregation": mode, "policy_loss": policy, "mismatch_correction": correction})
    full = inputs(2)
    full_loss, full_metrics = call(cfg, full, slice(None))
    full_loss.backward()
    split = {k: v.detach().clone().requires_grad_(k in LEAVES) for k, v in inputs(2).items()}
    chunks = [slice(0, 2), slice(2, 3), slice(3, 5)]  # the last one holds an environment-only sequence
    normalizer = sum(aggregation_normalizer(mode, MASK[c]) for c in chunks)  # what an all-reduce would give
    total, summed = 0.0, {}
    for rows in chunks:
        loss, metrics = call(cfg, split, rows, normalizer)
        loss.backward()  # gradients accumulate over micro-batches, as in the trainer
        total += loss.item()
        share = aggregation_normalizer(mode, MASK[rows]) / normalizer  # metrics are local means
        for key, value in metrics.items():
            if key.endswith(("_max", "_min")):  # extremes combine by max / min, as the backend does
                summed[key] = (max if key.endswith("_max") else min)(summed.get(key, value), value)
            else:
                summed[key] = summed.get(key, 0.0) + value * share
    assert total == pytest.approx(full_loss.item(), rel=1e-10)
    assert set(summed) == set(full_metrics)
    for key, value in full_metrics.items():
        assert summed[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for name in LEAVES:
        torch.testing.assert_close(split[name].grad, full[name].grad, rtol=1e-10, atol=1e-14)


def test_a_micro_batch_of_environment_tokens_only_contributes_nothing():
    x = inputs(5)
    loss, metrics = call(AlgorithmConfig(**FULL_CFG), x, slice(4, 5), normalizer=10.0)  # row 4: no policy token
    loss.backward()
    assert loss.item() == 0.0 and all(v == 0.0 for v in metrics.values())
    assert torch.equal(x["logprobs"].grad, torch.zeros_like(x["logprobs"]))


def test_sft_loss_micro_batches_add_up():
    x = inputs(6)
    full, _ = sft_loss(x["logprobs"], MASK, aggregation="seq_mean_token_sum")
    n = aggregation_normalizer("seq_mean_token_sum", MASK)
    parts = [sft_loss(x["logprobs"][c], MASK[c], aggregation="seq_mean_token_sum", normalizer=n)[0]
             for c in (slice(0, 1), slice(1, 5))]  # fmt: skip
    assert sum(p.item() for p in parts) == pytest.approx(full.item(), rel=1e-12)


def test_missing_inputs_and_contradictions_fail_loudly():
    x = inputs(3)
    args = (x["logprobs"], x["old_logprobs"], x["advantages"], MASK)
    with pytest.raises(ValueError, match="kl_loss_coef = 0.1 needs ref_logprobs"):
        rl_loss(AlgorithmConfig(kl_loss_coef=0.1), *args)
    with pytest.raises(ValueError, match="entropy_coef = 0.01 needs entropy"):
        rl_loss(AlgorithmConfig(entropy_coef=0.01), *args)
    with pytest.raises(ValueError, match="distill_coef = 1.0 needs teacher_logprobs"):
        rl_loss(AlgorithmConfig(distill_coef=1.0), *args)
    with pytest.raises(ValueError, match="'tis' needs rollout_logprobs"):
        rl_loss(AlgorithmConfig(mismatch_correction="tis"), *args)
    with pytest.raises(ValueError, match="old_logprobs = .rollout."):
        rl_loss(AlgorithmConfig(mismatch_correction="tis", old_logprobs="rollout"), *args,
                rollout_logprobs=x["rollout_logprobs"])  # fmt: skip
    with pytest.raises(ValueError, match="values, old_values and returns together"):
        rl_loss(AlgorithmConfig(), *args, values=x["values"])
    with pytest.raises(ValueError, match=r"entropy has shape \(5, 5\)"):
        rl_loss(AlgorithmConfig(), *args, entropy=torch.zeros(5, 5))


def test_plain_grpo_loss_without_extras_reports_only_policy_metrics():
    x = inputs(4)
    loss, metrics = rl_loss(AlgorithmConfig(), x["logprobs"], x["old_logprobs"], x["advantages"], MASK)
    assert set(metrics) == {"train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/loss"}
    assert metrics["train/loss"] == metrics["train/pg_loss"] == loss.item()
