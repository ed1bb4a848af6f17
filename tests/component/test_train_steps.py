"""The RL train step over a real 1-rank backend: on-policy invariants and metric wiring."""

import asyncio
import contextlib
import functools
import random

import pytest
import torch

from verst.config import batch_plan, load_config
from verst.config.schema import ClusterConfig
from verst.orchestration import Orchestration, RaySession, TrainBatchRef
from verst.run.guard import Guard
from verst.run.lanes import Lane
from verst.run.trainer_setup import open_trainer
from verst.run.training import DeviceShare, TrainerGroup
from verst.trainer import FSDP2Backend, InProcessRank
from verst.trainer.rl_steps import old_logprob_source, old_logprobs, train_on_groups
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


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in trainer.named_weights(1 << 30) for n, t in b}


def _on_policy(trainer, groups) -> None:
    """Give the samples the logprobs the engine would have reported for the trainer's weights."""
    samples = [s for g in groups for s in g]
    for s, lp in zip(samples, trainer.logprobs(samples)):
        s.rollout_logprobs = lp.tolist()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_first_step_is_on_policy_and_updates(tiny_model_dir, estimator):
    cfg = load_config(None, ["--model.path", str(tiny_model_dir), "--trainer.lr", "1e-3",
                             "--algorithm.advantage-estimator", estimator, "--algorithm.entropy-coef", "0.01"])
    groups = make_groups(4, 4)
    with open_trainer(cfg, total_steps=2) as trainer:
        _on_policy(trainer, groups)
        before = _weights(trainer)
        metrics = train_on_groups(trainer, groups, cfg)
        after = _weights(trainer)
    assert metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["train/pg_clipfrac"] == 0.0
    assert metrics["train/rollout_logprob_abs_diff"] < 1e-5
    assert metrics["train/entropy"] > 0 and metrics["train/grad_norm"] > 0
    assert metrics["train/advantage_abs_mean"] > 0
    assert any(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("extra", [[], ["--algorithm.entropy-coef", "0.01", "--algorithm.policy-loss", "gspo"]])
def test_reading_old_logprobs_off_the_step_forward_equals_recomputing_them(tiny_model_dir, extra):
    """`auto` with one step per batch reads the old policy off the train forward; the step (weights and
    metrics) must equal the one with a separate recompute pass."""
    base = ["--model.path", str(tiny_model_dir), "--trainer.lr", "1e-3", *extra]
    groups = make_groups(4, 4, seed=1)
    results = {}
    for mode in ("auto", "recompute"):
        cfg = load_config(None, base + ["--algorithm.old-logprobs", mode])
        with open_trainer(cfg, total_steps=2) as trainer:
            _on_policy(trainer, groups)
            metrics = train_on_groups(trainer, groups, cfg)
            results[mode] = (metrics, _weights(trainer))
    assert old_logprob_source(load_config(None, base)) == "forward"
    (forward, w_forward), (recompute, w_recompute) = results["auto"], results["recompute"]
    assert forward["time/logprob_s"] < recompute["time/logprob_s"]  # no pass at all vs one forward
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/rollout_logprob_abs_diff"):
        assert forward[key] == pytest.approx(recompute[key], rel=1e-4, abs=1e-6), key
    for name in w_forward:
        torch.testing.assert_close(w_forward[name], w_recompute[name], rtol=1e-5, atol=1e-6)


@contextlib.contextmanager
def ray_rank(cfg, total_steps):
    """One trainer rank actor on a local Ray (as an RL run starts it), and a batch's groups go to it as an
    object reference, which the rank resolves."""
    with RaySession(slots=1, log_to_driver=False), \
            Orchestration(ClusterConfig(trainer_ranks=1, device="cpu"), engines=False, timeout_s=120) as orch:
        yield orch.start_trainer(functools.partial(FSDP2Backend, cfg.model, cfg.trainer, total_steps=total_steps,
                                                   device="cpu"))


def in_process_batch(groups):
    return TrainBatchRef(groups, len(groups))


def object_store_batch(groups):
    import ray

    return TrainBatchRef(ray.put(groups), len(groups))


@pytest.mark.parametrize("start_trainer, as_ranks, make_batch", [
    (lambda cfg: open_trainer(cfg, total_steps=2), InProcessRank, in_process_batch),
    (lambda cfg: ray_rank(cfg, total_steps=2), lambda group: group, object_store_batch),
], ids=["in_process", "ray_rank"])
def test_steps_of_one_rollout_see_the_policy_from_before_its_first_step(tiny_model_dir, start_trainer, as_ranks,
                                                                        make_batch):
    """Two optimizer steps per rollout batch: the old logprobs are taken once, before the first step, and
    kept with the batch where the steps run (in this process, or on the rank, which receives the groups
    once), so the second step's importance ratios differ from 1 (PPO's clip can act), as in Miles."""
    cfg = load_config(None, ["--model.path", str(tiny_model_dir), "--trainer.lr", "3e-2",
                             "--rollout.batch-size", "4", "--rollout.n-samples-per-prompt", "4",
                             "--trainer.global-batch-size", "8", "--algorithm.max-token-staleness", "0"])
    assert old_logprob_source(cfg) == "recompute"
    groups = make_groups(4, 4, seed=2)
    lane = Lane(cfg, batch_plan(cfg), rollout=None)

    async def steps(group, batch) -> list[dict[str, float]]:
        return [m async for m in group.train(batch, lane, version=0)]

    async def nothing_to_settle() -> None:
        pass

    with start_trainer(cfg) as trainer:
        # no watchdog: unguarded steps; disaggregated: no engine memory to release
        group = TrainerGroup(as_ranks(trainer), Guard(cfg.fault), DeviceShare(None, nothing_to_settle), started_at=0.0)
        _on_policy(trainer, groups)
        first, second = asyncio.run(steps(group, make_batch(groups)))
    assert first["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # the policy has not moved yet
    assert abs(second["train/ppo_kl"]) > 1e-4  # it has, by the first step (a per-step recompute gives 0 here)
    assert second["train/rollout_logprob_abs_diff"] < 1e-5  # old policy = the sampling policy
    assert first["time/logprob_s"] > 0
    # every token was sampled by version 0: fresh at the first step (trainer version 0), one version old at
    # the second, where max_token_staleness = 0 rejects them all
    assert first["train/token_staleness_mean"] == 0 and first["train/stale_token_reject_frac"] == 0
    assert second["train/token_staleness_mean"] == pytest.approx(1.0) and second["train/stale_token_frac"] == 1
    assert second["train/stale_token_reject_frac"] == 1


def test_old_logprobs_from_the_rollout_are_the_engines(tiny_model_dir):
    cfg = load_config(None, ["--model.path", str(tiny_model_dir), "--algorithm.old-logprobs", "rollout"])
    groups = make_groups(2, 4, seed=3)
    old = old_logprobs(None, groups, cfg)  # no trainer needed: nothing is recomputed
    assert [o.tolist() for o in old] == [s.rollout_logprobs for g in groups for s in g]


def test_old_logprob_source_resolution():
    def source(*args: str, schedule: str = "sync") -> str:
        return old_logprob_source(load_config(None, ["--model.path", "m", "--schedule", schedule, *args]))

    assert source() == "forward"
    assert source("--rollout.batch-size", "4", "--trainer.global-batch-size", "8") == "recompute"  # 4 steps
    assert source("--rollout.batch-size", "4", "--trainer.global-batch-size", "8", schedule="fully_async") == "forward"
    assert source("--algorithm.advantage-estimator", "reinforce_plus_plus", "--algorithm.kl-penalty-coef", "0.1") \
        == "recompute"  # the penalty reads the old logprobs before the step
    assert source("--algorithm.old-logprobs", "recompute") == "recompute"
    assert source("--algorithm.old-logprobs", "rollout") == "rollout"


def test_kl_penalty_reads_recomputed_old_and_reference_logprobs(tiny_model_dir):
    """A KL penalty folded into the rewards needs the reference model (so the run builds one) and the
    old logprobs before the step (so `auto` recomputes them)."""
    cfg = load_config(None, ["--model.path", str(tiny_model_dir), "--trainer.lr", "1e-3",
                             "--algorithm.advantage-estimator", "reinforce_plus_plus",
                             "--algorithm.kl-penalty-coef", "0.1"])
    assert cfg.algorithm.needs_reference and old_logprob_source(cfg) == "recompute"
    groups = make_groups(2, 4, seed=4)
    with open_trainer(cfg, total_steps=1, ref_model_path=str(tiny_model_dir)) as trainer:
        _on_policy(trainer, groups)
        metrics = train_on_groups(trainer, groups, cfg)
    assert metrics["time/logprob_s"] > 0 and metrics["train/grad_norm"] > 0
    assert metrics["train/kl"] == pytest.approx(0.0, abs=1e-6)  # policy = reference before the first step
