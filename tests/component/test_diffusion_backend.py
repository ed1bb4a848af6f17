"""The diffusion train backend on a tiny denoiser (float32, CPU): its step logprobs are the sampler's, one RL step
through `train_on_groups` is a plain AdamW step on Flow-GRPO's loss, two gloo ranks step as one does, a checkpoint
resumes exactly, exports and weight sync give the trained denoiser, and refusals name the field."""

import pickle

import pytest
import torch

pytest.importorskip("diffusers")

from tests.spawned_ranks import TIMEOUT_S, gradients, spawn_ranks, synced_weights  # noqa: E402
from verst.algo.advantages import group_relative_rewards  # noqa: E402
from verst.algo.flow_grpo import flow_grpo_loss  # noqa: E402
from verst.config import load_config  # noqa: E402
from verst.config.schema import DiffusionConfig, ModelConfig, TrainerConfig  # noqa: E402
from verst.engine.diffusion_core import DiffusionCore, ImageJob  # noqa: E402
from verst.inference_client.images import ImageSamplingParams  # noqa: E402
from verst.inference_client.ports import free_port  # noqa: E402
from verst.models import diffusion  # noqa: E402
from verst.monitor.checkpoint_dirs import wait_trainer_writes  # noqa: E402
from verst.trainer import TrainBackend, diffusion_backend  # noqa: E402
from verst.trainer.diffusion_backend import DiffusionBackend  # noqa: E402
from verst.trainer.rl_steps import train_on_groups  # noqa: E402
from verst.types import Sample, Status  # noqa: E402
from verst.types.arrays import encode_array  # noqa: E402

torch.set_num_threads(1)
N_CLASSES, WIDTHS, STEPS, GUIDANCE, NOISE, LR = 9, (8, 16), 3, 1.5, 0.7, 1e-3
# two groups of uneven size (one image per micro-batch: on two ranks one of them runs a dummy forward)
GROUPS = [(2, [1.0, 0.0, 0.5]), (5, [0.2, 0.9])]  # (class, rewards)
GRAD_NOISE = 1e-8  # float32 noise of a gradient summed in another order (its largest entries are about 1e-2)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The policy's denoiser and another one as the frozen reference (its KL term has a gradient)."""
    root = tmp_path_factory.mktemp("denoisers")
    for name, seed in (("policy", 0), ("reference", 1)):
        diffusion.save(diffusion.init_denoiser(N_CLASSES, widths=WIDTHS, seed=seed), root / name)
    return root / "policy", root / "reference"


IMAGE_RUN = ["--model.kind", "diffusion", "--cluster.engine", "diffusion", "--cluster.device", "cpu",
             "--reward.type", "jpeg_compressibility"]


def run_config(policy_dir, kl: float = 0.1):
    return load_config(None, [*IMAGE_RUN, "--model.path", str(policy_dir), "--trainer.lr", str(LR),
                              "--trainer.grad-clip", "1e9",
                              "--trainer.max-tokens-per-micro-batch", str(STEPS + 1),
                              "--algorithm.policy-loss", "flow_grpo", "--algorithm.kl-loss-coef", str(kl),
                              "--diffusion.num-inference-steps", str(STEPS),
                              "--diffusion.guidance-scale", str(GUIDANCE), "--diffusion.noise-level", str(NOISE)])


def make_groups(model, seed: int = 7) -> tuple[list[list[Sample]], diffusion.Trajectory]:
    """Image trajectories sampled from `model` as the engine reports them: one group per class."""
    labels = torch.tensor([label for label, rewards in GROUPS for _ in rewards])
    traj = diffusion.sample(model, labels, seed=seed, steps=STEPS, guidance=GUIDANCE, noise_level=NOISE)
    groups, i = [], 0
    for g, (label, rewards) in enumerate(GROUPS):
        group = []
        for reward in rewards:
            group.append(Sample(tokens=[label, *range(STEPS)], response_length=STEPS, loss_mask=[1] * STEPS,
                                rollout_logprobs=traj.logprobs[i].tolist(), latents=encode_array(traj.latents[i].numpy()),
                                reward=reward, status=Status.COMPLETED, weight_versions=["0"], group_index=g, index=i))
            i += 1
        groups.append(group)
    return groups, traj


def build(cfg, reference=None) -> DiffusionBackend:
    return DiffusionBackend(cfg.model, cfg.trainer, cfg.diffusion, ref_model_path=str(reference) if reference else None,
                            device="cpu")


def rl_step(backend, groups, cfg) -> dict:
    """Logprobs of the batch, one RL step: its metrics, gradients and updated weights."""
    samples = [s for g in groups for s in g]
    logprobs = backend.logprobs(samples)
    metrics = train_on_groups(backend, groups, cfg)
    return {"logprobs": logprobs, "metrics": metrics, "grads": gradients(backend), "weights": synced_weights(backend)}


def test_logprobs_are_the_samplers(model_dirs):
    policy_dir, reference_dir = model_dirs
    cfg = run_config(policy_dir)
    groups, traj = make_groups(diffusion.load(policy_dir))
    backend = diffusion_backend(cfg.model, cfg.trainer, cfg.diffusion, ref_model_path=str(reference_dir), device="cpu")
    assert isinstance(backend, DiffusionBackend) and isinstance(backend, TrainBackend)
    samples = [s for g in groups for s in g]
    got = backend.logprobs(samples)
    assert [tuple(lp.shape) for lp in got] == [(STEPS,)] * len(samples)
    assert (torch.stack(got) - traj.logprobs).abs().max().item() <= 1e-5
    # the frozen reference is the other denoiser's, item by item in batch order
    labels = torch.tensor([s.tokens[0] for s in samples])
    with torch.no_grad():
        want = diffusion.step_logprobs(diffusion.load(reference_dir), traj.latents, labels, guidance=GUIDANCE,
                                       noise_level=NOISE)
    reference = torch.stack(backend.logprobs(samples, reference=True))
    assert (reference - want).abs().max().item() <= 1e-5
    assert (reference - traj.logprobs).abs().max().item() > 1e-2


def test_one_rl_step_is_adamw_on_the_flow_grpo_loss(model_dirs):
    policy_dir, reference_dir = model_dirs
    cfg = run_config(policy_dir)
    model = diffusion.load(policy_dir)
    groups, traj = make_groups(model)
    samples = [s for g in groups for s in g]
    got = rl_step(build(cfg, reference_dir), groups, cfg)

    # flow_grpo_step's computation on an unsharded copy: one AdamW step on the whole batch
    labels = torch.tensor([s.tokens[0] for s in samples])
    advantages = group_relative_rewards(torch.tensor([s.reward for s in samples]),
                                        torch.tensor([s.group_index for s in samples]), std_normalize=True)
    with torch.no_grad():
        ref = diffusion.step_logprobs(diffusion.load(reference_dir), traj.latents, labels, guidance=GUIDANCE,
                                      noise_level=NOISE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=cfg.trainer.adam_betas, weight_decay=0.0)
    model.train()
    loss, n = 0.0, len(samples)
    for i in range(n):  # flow_grpo_step's accumulation, one image per micro-batch as the backend's budget gives
        logprobs = diffusion.step_logprobs(model, traj.latents[i:i + 1], labels[i:i + 1], guidance=GUIDANCE,
                                           noise_level=NOISE)
        part, _ = flow_grpo_loss(logprobs, traj.logprobs[i:i + 1], advantages[i:i + 1], eps_clip=cfg.algorithm.eps_clip,
                                 kl_coef=cfg.algorithm.kl_loss_coef, ref_logprobs=ref[i:i + 1])
        (part / n).backward()
        loss += part.item() / n
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    want_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizer.step()

    metrics = got["metrics"]
    assert metrics["train/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert metrics["train/kl"] > 0 and metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert metrics["train/lr"] == LR and metrics["perf/train_tokens_per_s"] > 0
    assert_by_name(got["grads"], want_grads, atol=GRAD_NOISE, rtol=1e-5)
    before = diffusion.load(policy_dir).state_dict()
    assert max((got["weights"][n] - t).abs().max().item() for n, t in before.items()) > LR / 2  # the step moved them
    assert_by_name(got["weights"], model.state_dict(), atol=1e-6, where=above_noise(want_grads))


def above_noise(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Where a gradient is far enough above float32 noise for AdamW's first step to be compared. That step moves a
    weight by lr * g / (|g| + eps), whose slope eps / (|g| + eps)^2 multiplies the gradient's noise: at |g| = 10x
    the noise (1e-7) a noise of 1e-8 moves it by up to 8e-6, at 100x (1e-6) by 1e-7, inside the comparison's 1e-6.
    With one channel per GroupNorm group (the first level's 8 channels), a bias added before the norm has no
    gradient in exact arithmetic, and the step turns its noise into a move of up to lr. The entries below 100x the
    noise are left out of a comparison of the updated weights."""
    where = {name: g.abs() > 100 * GRAD_NOISE for name, g in grads.items()}
    compared = sum(int(m.sum()) for m in where.values()) / sum(m.numel() for m in where.values())
    assert compared > 0.95, f"only {compared:.0%} of the gradient is above noise"
    return where


def assert_by_name(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float, rtol: float = 0.0,
                   where: dict[str, torch.Tensor] | None = None) -> None:
    """The same names, each tensor within `atol` + `rtol` x |want| of `want`'s (at `where`); the worst one named."""
    assert got.keys() == want.keys()
    excess = {}
    for name, t in want.items():
        off = (got[name] - t).abs() - atol - rtol * t.abs()
        kept = off[where[name]] if where is not None else off.flatten()
        excess[name] = kept.max().item() if kept.numel() else float("-inf")
    worst = max(excess, key=excess.get)
    assert excess[worst] <= 0, f"{worst}: off by {(got[worst] - want[worst]).abs().max().item():.2e}"


def _rank(rank: int, world: int, port: int, policy_dir: str, reference_dir: str, groups, out: str) -> None:
    """One of `world` gloo ranks running `rl_step`; rank 0 writes what it returned."""
    import torch.distributed as dist

    from verst.trainer.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world, "127.0.0.1", port, torch.device("cpu"), timeout_s=TIMEOUT_S)
    try:
        cfg = run_config(policy_dir)
        result = rl_step(build(cfg, reference_dir), groups, cfg)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_step_as_one(model_dirs, tmp_path):
    policy_dir, reference_dir = model_dirs
    cfg = run_config(policy_dir)
    groups, _ = make_groups(diffusion.load(policy_dir))
    want = rl_step(build(cfg, reference_dir), groups, cfg)
    out = tmp_path / "world2.pkl"
    got = spawn_ranks(_rank, 2, (2, free_port(), str(policy_dir), str(reference_dir), groups, str(out)), out,
                      TIMEOUT_S)
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for key in ("train/loss", "train/kl", "train/pg_loss", "train/grad_norm"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-7), key
    assert_by_name(got["grads"], want["grads"], atol=GRAD_NOISE, rtol=1e-5)
    assert_by_name(got["weights"], want["weights"], atol=1e-5, where=above_noise(want["grads"]))


def _optimizer_state(backend) -> dict[str, torch.Tensor]:
    state = backend.optimizer.state_dict()["state"]
    return {f"{i}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for i, entry in state.items() for k, v in entry.items()}


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_checkpoint_resumes_exactly(model_dirs, tmp_path, background):
    policy_dir, reference_dir = model_dirs
    cfg = run_config(policy_dir)
    groups, _ = make_groups(diffusion.load(policy_dir))
    trainer = build(cfg, reference_dir)
    train_on_groups(trainer, groups, cfg)
    saved_weights, saved_optimizer = synced_weights(trainer), _optimizer_state(trainer)
    trainer.save(tmp_path / "ckpt", background=background)
    next_metrics = train_on_groups(trainer, groups, cfg)  # while a background write may still run
    if background:
        trainer.wait_saves()
        wait_trainer_writes(tmp_path / "ckpt", ranks=1, step=1)  # the driver's part: COMPLETE once every rank is done

    resumed = build(cfg, reference_dir)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 1
    for name, tensor in saved_weights.items():
        assert torch.equal(synced_weights(resumed)[name], tensor), name
    restored = _optimizer_state(resumed)
    assert restored.keys() == saved_optimizer.keys() and len(restored) > 0
    for key, tensor in saved_optimizer.items():
        assert torch.equal(restored[key], tensor), key
    again = train_on_groups(resumed, groups, cfg)
    assert resumed.step == trainer.step == 2
    steady = {k: v for k, v in next_metrics.items() if not k.startswith(("time/", "perf/"))}
    assert {k: again[k] for k in steady} == steady
    for name, tensor in synced_weights(trainer).items():
        assert torch.equal(synced_weights(resumed)[name], tensor), name


def test_exports_and_weight_sync_give_the_trained_denoiser(model_dirs, tmp_path):
    policy_dir, reference_dir = model_dirs
    cfg = run_config(policy_dir, kl=0.0)
    groups, _ = make_groups(diffusion.load(policy_dir))
    trainer = build(cfg)
    train_on_groups(trainer, groups, cfg)
    trained = synced_weights(trainer)
    assert max((trained[n] - t).abs().max().item() for n, t in diffusion.load(policy_dir).state_dict().items()) > 0

    trainer.export_hf(tmp_path / "hf")
    exported = diffusion.load(tmp_path / "hf")
    assert type(exported).__name__ == "UNet2DModel" and exported.config.num_class_embeds == N_CLASSES + 1
    assert exported.state_dict().keys() == trained.keys()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, trained[name]), name

    # weight sync: small buckets into an engine core holding another denoiser; its images are the trainer's
    core = DiffusionCore(diffusion.init_denoiser(N_CLASSES, widths=WIDTHS, seed=5))
    count = core.load_weights([named for bucket in trainer.named_weights(1 << 12) for named in bucket], version="1")
    assert count == len(trained) and core.weight_version == "1"
    params = ImageSamplingParams(num_inference_steps=STEPS, guidance_scale=GUIDANCE, noise_level=NOISE, n=2)
    job = ImageJob(rid="r", label=3, seed=11, params=params, return_logprob=True)
    _, images = core.generate([job])[job.key]
    with torch.no_grad():
        want = diffusion.sample(trainer.model, torch.tensor([3]), seed=12, steps=STEPS, guidance=GUIDANCE,
                                noise_level=NOISE)
    assert torch.allclose(images[1].latents, want.latents, atol=1e-5)  # sampled in a batch of 2
    assert torch.allclose(images[1].logprobs, want.logprobs, atol=1e-5)


def test_refusals_name_the_field(model_dirs):
    policy_dir, _ = model_dirs
    cfg = run_config(policy_dir, kl=0.0)
    groups, _ = make_groups(diffusion.load(policy_dir))
    samples = [s for g in groups for s in g]
    backend = build(cfg)
    with pytest.raises(ValueError, match="algorithm.entropy_coef"):
        backend.logprobs(samples, with_entropy=True)
    with pytest.raises(ValueError, match="algorithm.entropy_coef"):
        backend.train_step(samples, lambda *a: None, with_entropy=True)
    with pytest.raises(ValueError, match="algorithm.advantage_estimator"):
        backend.values(samples)
    with pytest.raises(ValueError, match="algorithm.advantage_estimator"):
        backend.train_critic(samples, lambda *a: None)
    with pytest.raises(ValueError, match="merge_lora"):
        backend.export_hf("unused", merge_lora=True)
    text = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0])
    with pytest.raises(ValueError, match=r"train items \[1\] carry no latents"):
        backend.logprobs([samples[0], text])
    assert backend.step == 0
    model, diffusion_cfg = ModelConfig(path=str(policy_dir)), DiffusionConfig()
    for field in ("tensor_parallel_size", "context_parallel_size", "expert_parallel_size"):
        with pytest.raises(ValueError, match=f"trainer.{field} = 2"):
            DiffusionBackend(model, TrainerConfig(**{field: 2}), diffusion_cfg, device="cpu")
    with pytest.raises(ValueError, match="model.dtype = 'bfloat16'"):
        DiffusionBackend(ModelConfig(path=str(policy_dir), dtype="bfloat16"), TrainerConfig(), diffusion_cfg,
                         device="cpu")


def test_flow_grpo_steps_through_the_rl_step_raise_a_reward(tmp_path):
    """The run's loop in miniature: a sampler with the pushed weights draws groups, the reward (brightness)
    scores them, `train_on_groups` steps the backend; held-out seeds get brighter."""
    diffusion.save(diffusion.init_denoiser(N_CLASSES, widths=WIDTHS, seed=0), tmp_path / "base")
    cfg = load_config(None, [*IMAGE_RUN, "--model.path", str(tmp_path / "base"), "--trainer.lr", "3e-3",
                             "--algorithm.policy-loss", "flow_grpo", "--diffusion.num-inference-steps", "4"])
    backend = DiffusionBackend(cfg.model, cfg.trainer, cfg.diffusion, device="cpu")
    sampler = diffusion.load(tmp_path / "base")
    labels = torch.arange(4)

    def held_out() -> float:
        return diffusion.sample(sampler, labels.repeat(4), seed=999, steps=4).images.mean().item()

    before = held_out()
    for step in range(6):
        group_labels = labels.repeat_interleave(6)
        traj = diffusion.sample(sampler, group_labels, seed=step, steps=4)
        rewards = traj.images.mean(dim=(1, 2, 3))
        groups = [[Sample(tokens=[int(group_labels[i]), *range(4)], response_length=4, loss_mask=[1] * 4,
                          rollout_logprobs=traj.logprobs[i].tolist(), latents=encode_array(traj.latents[i].numpy()),
                          reward=float(rewards[i]), status=Status.COMPLETED, group_index=g, index=i)
                   for i in range(6 * g, 6 * g + 6)] for g in range(4)]
        metrics = train_on_groups(backend, groups, cfg)
        sampler.load_state_dict({name: t for bucket in backend.named_weights(2**20) for name, t in bucket})
    assert {"train/pg_loss", "train/pg_clipfrac", "train/grad_norm"} <= set(metrics)
    assert held_out() > before + 0.05
