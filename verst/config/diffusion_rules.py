"""The rules of a diffusion run (`model.kind = "diffusion"`, docs/diffusion.md): part of `verst.config.rules.RULES`.
An image trajectory is a class id and its denoising steps, so what needs text, a tokenizer or a language model's
structure is refused by name, with what the run can use instead.
"""

from __future__ import annotations

from verst.config.engine_rules import engines_with
from verst.config.inputs import ModelConfig, RewardConfig
from verst.config.registries import ADVANTAGE_ESTIMATORS, ENGINE_KINDS, REWARDS
from verst.config.runtime import ClusterConfig
from verst.config.section import Section


def image_engines_serve_diffusion_models(model: ModelConfig, cluster: ClusterConfig) -> None:
    """A denoiser needs an engine that draws images, and such an engine serves nothing else."""
    images = ENGINE_KINDS.entry(cluster.engine).images
    if model.kind == "diffusion" and not images:
        raise ValueError(f"model.kind = 'diffusion' needs an engine that samples images: cluster.engine = "
                         f"{engines_with('images')}, "
                         f"not {cluster.engine!r}")
    if images and model.kind != "diffusion":
        raise ValueError(f"cluster.engine = {cluster.engine!r} samples images from a denoiser; model.kind = "
                         f"{model.kind!r} needs a text engine (cluster.engine = 'embedded')")


# (field, its off value, why an image run has no use for it); read off the config tree by dotted name
_TEXT_ONLY: tuple[tuple[str, object, str], ...] = (
    ("lora.enabled", False, "LoRA adapters target a language model's linear layers; train the denoiser in full"),
    ("teacher.model_path", None, "on-policy distillation scores text tokens"),
    ("rollout.partial_rollout", False, "an image is sampled in one engine call"),
    ("rollout.over_sampling_batch_size", None, "a diffusion run launches rollout.batch_size prompts a step"),
    ("algorithm.true_on_policy", False, "it is the text engine's scoring pass"),
    ("algorithm.routing_replay", "off", "a denoiser has no experts"),
    ("algorithm.distill_coef", 0.0, "on-policy distillation scores text tokens"),
    ("trainer.tensor_parallel_size", 1, "the denoiser is sharded with FSDP2 only"),
    ("trainer.context_parallel_size", 1, "the denoiser is sharded with FSDP2 only"),
    ("trainer.expert_parallel_size", 1, "a denoiser has no experts"),
    ("trainer.sequence_parallel", False, "the denoiser is sharded with FSDP2 only"),
    ("trainer.gradient_checkpointing", False, "the denoiser's activations are small"),
    ("model.dtype", "float32", "the denoiser trains and samples in float32"),
    ("cluster.device", "cpu", "the diffusion engine samples on the CPU"),
    ("eval.backend", None, "images are evaluated on the run's engines"),
    ("eval.num_engines", 0, "images are evaluated on the run's engines"),
    ("sandbox.provider", None, "sandboxes serve an agent's tools"),
    ("rollout.agent_fn", None, "an agent runs text episodes"),
    ("sync.check_weights", False, "it compares text logprobs; train/rollout_logprob_abs_diff compares each step's"),
)


def diffusion_runs_use_what_images_have(config: Section) -> None:
    """Each text-only setting at its off value, and an advantage estimator without a critic."""
    if config.model.kind != "diffusion":
        return
    for field, off, why in _TEXT_ONLY:
        value = config
        for part in field.split("."):
            value = getattr(value, part, None)
        if value != off:
            raise ValueError(f"{field} = {_shown(value)} does not apply to model.kind = 'diffusion' ({why}); "
                             f"leave it at {_shown(off)}")
    estimator = config.algorithm.advantage_estimator
    if ADVANTAGE_ESTIMATORS.entry(estimator).needs_critic:
        raise ValueError(f"algorithm.advantage_estimator = {estimator!r} needs a value model, which a diffusion run "
                         "does not build; use 'grpo', 'dr_grpo' or 'rloo'")
    if config.algorithm.entropy_coef > 0:
        raise ValueError(f"algorithm.entropy_coef = {config.algorithm.entropy_coef} does not apply to model.kind = "
                         "'diffusion' (a Gaussian step's entropy does not depend on the weights); leave it at 0")


def stale_images_take_the_engines_logprobs(config: Section) -> None:
    """Where images may be a version stale (one-step-off, fully async), the old policy is the engine's: a step's
    log-probability is a mean over the latent's elements, and with the trainer's own as the old policy stale images
    pull the denoiser off the reward (measured: docs/benchmarks.md)."""
    if config.model.kind != "diffusion" or config.schedule == "sync" or config.algorithm.old_logprobs == "rollout":
        return
    raise ValueError(f"schedule = {config.schedule!r} trains on images sampled by older weights; with model.kind = "
                     f"'diffusion' set algorithm.old_logprobs = 'rollout' (the engine's step log-probabilities as the "
                     f"old policy, with a small algorithm.eps_clip such as 1e-4), not "
                     f"{config.algorithm.old_logprobs!r}, or use schedule = 'sync'")


def rewards_score_what_the_model_makes(model: ModelConfig, reward: RewardConfig) -> None:
    """An image reward for a denoiser, a text reward for a language model; a model file where the reward needs one,
    and a key that selects a dict reward's component."""
    if reward.type not in REWARDS:
        return  # 'custom' and 'remote' score whatever they are given
    entry = REWARDS.entry(reward.type)
    if entry.images != (model.kind == "diffusion"):
        made = "images" if model.kind == "diffusion" else "text"
        others = [name for name in REWARDS if REWARDS.entry(name).images == (model.kind == "diffusion")]
        raise ValueError(f"reward.type = {reward.type!r} does not score {made} (model.kind = {model.kind!r}); "
                         f"use one of {others}, 'custom' or 'remote'")
    if entry.takes_model and not reward.model_path:
        raise ValueError(f"reward.type = {reward.type!r} scores with a model of its own: set reward.model_path")
    if entry.keys and reward.key not in entry.keys:
        raise ValueError(f"reward.type = {reward.type!r} returns the components {list(entry.keys)}; "
                         f"reward.key = {reward.key!r} must select one")


def _shown(value: object) -> str:
    """A value as a recipe writes it: true, 0.0, 'cpu'."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


DIFFUSION_RULES = (image_engines_serve_diffusion_models, diffusion_runs_use_what_images_have,
                   stale_images_take_the_engines_logprobs, rewards_score_what_the_model_makes)
