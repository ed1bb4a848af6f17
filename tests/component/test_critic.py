"""PPO's critic on a real 1-rank backend: values, its clipped-value-loss steps, checkpoints and exports."""

import pytest
import torch

from tests.component.test_train_steps import _on_policy, _weights, make_groups
from verst.config import load_config
from verst.run.trainer_setup import open_trainer
from verst.trainer.rl_steps import train_on_groups, train_rollout_step


def ppo_config(model_dir, *extra):
    return load_config(None, ["--model.path", str(model_dir), "--trainer.lr", "1e-3",
                              "--algorithm.advantage-estimator", "ppo", "--critic.lr", "3e-3", *extra])


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_ppo_steps_fit_the_critic_to_the_returns_and_train_the_policy(tiny_model_dir, impl):
    cfg = ppo_config(tiny_model_dir, "--model.impl", impl)
    groups = make_groups(4, 4)
    samples = [s for g in groups for s in g]
    with open_trainer(cfg, total_steps=8, critic=True) as trainer:
        _on_policy(trainer, groups)
        names = {n: t.shape for n, t in _weights(trainer).items()}
        assert all(torch.equal(v, torch.zeros_like(v)) for v in trainer.values(samples))  # the zero-initialised head
        before = _weights(trainer)
        steps = [train_on_groups(trainer, groups, cfg) for _ in range(8)]
        after = _weights(trainer)
    first, last = steps[0], steps[-1]
    # every value starts at 0: the returns are the rewards (γ = λ = 1), the loss ½·mean(r²) over tokens
    assert first["train/value_mean"] == 0.0 and first["train/value_loss"] > 0.1
    assert last["train/value_loss"] < 0.3 * first["train/value_loss"], [s["train/value_loss"] for s in steps]
    assert last["train/explained_variance"] > first["train/explained_variance"]
    for m in steps:
        assert m["train/value_grad_norm"] > 0 and m["train/value_lr"] == pytest.approx(3e-3)
        assert m["train/grad_norm"] > 0 and m["train/lr"] == pytest.approx(1e-3)
        assert 0.0 <= m["train/value_clipfrac"] <= 1.0
    assert {n: t.shape for n, t in after.items()} == names  # weight sync sees the policy alone
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_the_value_clip_bounds_the_critic_over_a_rollout_batch(tiny_model_dir):
    """Two optimizer steps per rollout batch: the values are taken once, before the first, so the second
    step's value clip is measured from them and acts once the critic has moved."""
    cfg = ppo_config(tiny_model_dir, "--rollout.batch-size", "4", "--rollout.n-samples-per-prompt", "4",
                     "--trainer.global-batch-size", "8", "--critic.lr", "5e-2", "--algorithm.value-clip", "0.01")
    groups = make_groups(4, 4, seed=1)
    with open_trainer(cfg, total_steps=2, critic=True) as trainer:
        _on_policy(trainer, groups)
        first = train_rollout_step(trainer, groups, 0, cfg)
        second = train_rollout_step(trainer, None, 2, cfg)
    assert first["train/value_clipfrac"] == 0.0  # the critic has not moved yet
    assert second["train/value_clipfrac"] > 0.0
    assert first["train/value_mean"] == second["train/value_mean"] == 0.0  # both from before the first step


def test_checkpoints_hold_the_critic_and_exports_leave_it_out(tiny_model_dir, tmp_path):
    cfg = ppo_config(tiny_model_dir)
    groups = make_groups(2, 4, seed=5)
    samples = [s for g in groups for s in g]
    with open_trainer(cfg, total_steps=4, critic=True) as trainer:
        _on_policy(trainer, groups)
        train_on_groups(trainer, groups, cfg)
        trainer.save(tmp_path / "ckpt")
        trainer.export_hf(tmp_path / "hf")
        saved_values = trainer.values(samples)
        next_step = train_on_groups(trainer, groups, cfg)
    with open_trainer(cfg, total_steps=4, critic=True) as resumed:
        resumed.load(tmp_path / "ckpt")
        assert all(torch.equal(a, b) for a, b in zip(resumed.values(samples), saved_values))
        again = train_on_groups(resumed, groups, cfg)
    for key in ("train/value_loss", "train/value_grad_norm", "train/value_lr", "train/loss"):
        assert again[key] == pytest.approx(next_step[key], rel=1e-5), key  # optimizer and schedules restored too
    exported = load_config(None, ["--model.path", str(tmp_path / "hf")])
    with open_trainer(exported, total_steps=1) as policy:
        assert {n: t.shape for n, t in _weights(policy).items()} == {n: t.shape for n, t in _weights(resumed).items()}
    grpo = load_config(None, ["--model.path", str(tiny_model_dir)])
    with open_trainer(grpo, total_steps=1) as plain:
        plain.save(tmp_path / "grpo")
    with open_trainer(cfg, total_steps=1, critic=True) as ppo, pytest.raises(ValueError, match="holds no value model"):
        ppo.load(tmp_path / "grpo")


def test_lora_policy_with_a_full_critic(tiny_model_dir):
    """LoRA adapts the policy only; the critic trains all its weights."""
    cfg = ppo_config(tiny_model_dir, "--lora.enabled", "true", "--lora.rank", "4")
    groups = make_groups(2, 4, seed=6)
    with open_trainer(cfg, total_steps=3, critic=True) as trainer:
        _on_policy(trainer, groups)
        steps = [train_on_groups(trainer, groups, cfg) for _ in range(3)]
        critic_params = list(trainer.critic.model.parameters())
    assert all(p.requires_grad for p in critic_params)
    assert steps[-1]["train/value_loss"] < steps[0]["train/value_loss"]
    assert all(m["train/grad_norm"] > 0 for m in steps)


def test_a_critic_of_another_vocabulary_is_refused():
    from types import SimpleNamespace

    from verst.trainer.critic import check_same_vocabulary

    def model(vocab):
        config = SimpleNamespace(vocab_size=vocab)
        return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: config))

    check_same_vocabulary(model(265), model(265), "critic")
    with pytest.raises(ValueError, match="critic.model_path = 'critic' has a vocabulary of 300 tokens, the policy 265"):
        check_same_vocabulary(model(300), model(265), "critic")


def test_two_critic_ranks_match_one(tiny_model_dir):
    """The critic sharded over 2 rank actors gives the values and steps of 1 rank; the single-sequence
    batch leaves one rank a dummy micro-batch, which keeps its collectives in step."""
    import dataclasses
    import functools

    import torch.distributed as dist

    from tests.component.test_trainer_actor_group import BATCHES, CONFIG, TOTAL_STEPS, trainer_ranks
    from verst.config import AlgorithmConfig, CriticConfig, ModelConfig
    from verst.orchestration import RaySession
    from verst.trainer import FSDP2Backend
    from verst.trainer.rl_steps import value_loss_fn

    make = functools.partial(FSDP2Backend, ModelConfig(path=str(tiny_model_dir)), CONFIG, total_steps=TOTAL_STEPS,
                             device="cpu", critic=CriticConfig(lr=1e-3))
    gen = torch.Generator().manual_seed(0)
    targets = [[dataclasses.replace(it, extras={"old_values": torch.zeros(it.response_length),
                                                "returns": torch.rand(it.response_length, generator=gen)})
                for it in items] for items in BATCHES]
    loss_fn = functools.partial(value_loss_fn, AlgorithmConfig(advantage_estimator="ppo"))
    with RaySession(slots=2, log_to_driver=False), trainer_ranks(make, world_size=2, timeout_s=120) as group:
        two = [(group.train_critic(items, loss_fn), group.values(items)) for items in targets]
    one_rank = make()
    try:
        for (got, got_values), items in zip(two, targets):
            want = one_rank.train_critic(items, loss_fn)
            for key in ("train/value_loss", "train/value_grad_norm", "train/value_lr"):
                assert got[key] == pytest.approx(want[key], rel=1e-4), key
            for a, b in zip(got_values, one_rank.values(items)):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # float sums in another order
        assert all(v.abs().max() > 0 for v in two[-1][1])  # the zero head has moved
    finally:
        dist.destroy_process_group()
