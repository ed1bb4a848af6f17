"""A tiny class-conditioned denoiser (diffusers' UNet2DModel), its flow-matching pretraining, and the
Flow-GRPO SDE sampler that records every denoising step's latent and log-probability.

Flow matching: x_t = (1 − t)·x_0 + t·ε, the model predicts the velocity v = ε − x_0, and sampling runs t from
1 to 0. The SDE sampler (Flow-GRPO, Liu et al. 2025, arXiv:2505.05470, eq. 9) adds noise of standard deviation
σ_t·√|dt| with σ_t = a·√(t / (1 − t)) around the mean

    μ = x_t + [v + σ_t² / (2t) · (x_t + (1 − t)·v)]·dt         (dt = t_next − t < 0)

so each step is a Gaussian whose log-density at the drawn x_{t+dt} is the step's log-probability (a mean over
the latent's elements, as Flow-GRPO's). `step_logprobs` recomputes those from the recorded latents; with the
sampler's weights it equals the sampler's values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import UNet2DModel

T_SCALE = 1000.0  # the model's timestep input is t · T_SCALE


def init_denoiser(n_classes: int, size: int = 16, widths: tuple[int, ...] = (32, 64), seed: int = 0) -> UNet2DModel:
    """A float32 UNet2DModel conditioned on a class (index `n_classes` is the unconditional one, for guidance)."""
    torch.manual_seed(seed)
    return UNet2DModel(
        sample_size=size, in_channels=3, out_channels=3, block_out_channels=widths, layers_per_block=1,
        down_block_types=("DownBlock2D",) * len(widths), up_block_types=("UpBlock2D",) * len(widths),
        num_class_embeds=n_classes + 1, norm_num_groups=8,
    ).float()


def velocity(model: UNet2DModel, x: torch.Tensor, t: float, labels: torch.Tensor, guidance: float) -> torch.Tensor:
    """The model's velocity at time t; with guidance ≠ 1, classifier-free guidance against the null class."""
    steps = torch.full((x.shape[0],), t * T_SCALE, dtype=x.dtype, device=x.device)
    cond = model(x, steps, class_labels=labels).sample
    if guidance == 1.0:
        return cond
    null = torch.full_like(labels, model.config.num_class_embeds - 1)
    uncond = model(x, steps, class_labels=null).sample
    return uncond + guidance * (cond - uncond)


def pretrain(model: UNet2DModel, images: torch.Tensor, labels: torch.Tensor, *, steps: int, batch_size: int = 64,
             lr: float = 2e-3, drop_label: float = 0.1, seed: int = 0) -> list[float]:
    """Flow-matching pretraining (‖v_θ(x_t, t) − (ε − x_0)‖²), dropping the label for guidance -> losses."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    null = model.config.num_class_embeds - 1
    losses = []
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, images.shape[0], (batch_size,), generator=gen)
        x0, y = images[idx], labels[idx].clone()
        y[torch.rand(batch_size, generator=gen) < drop_label] = null
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.rand(batch_size, generator=gen)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        pred = model(xt, t * T_SCALE, class_labels=y).sample
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


@dataclass
class Trajectory:
    """One sampling run: latents (batch, steps + 1, C, H, W), from the start noise to the image, and the
    log-probability of each step (batch, steps); `times` are the steps' t, from 1 towards 0."""

    latents: torch.Tensor
    logprobs: torch.Tensor
    times: list[float]

    @property
    def images(self) -> torch.Tensor:
        return self.latents[:, -1].clamp(-1, 1)


def time_grid(steps: int) -> list[float]:
    if steps < 1:
        raise ValueError(f"steps = {steps}: a sampler needs at least one step")
    return [1.0 - i / steps for i in range(steps + 1)]


def _sde_mean_std(x: torch.Tensor, v: torch.Tensor, t: float, t_next: float, noise_level: float,
                  t_cap: float) -> tuple[torch.Tensor, float]:
    """The Gaussian of one SDE step: its mean and standard deviation (σ_t·√|dt|, t capped below 1)."""
    s = min(t, t_cap)
    sigma = noise_level * math.sqrt(s / (1 - s))
    dt = t_next - t
    mean = x + (v + sigma**2 / (2 * s) * (x + (1 - s) * v)) * dt
    return mean, sigma * math.sqrt(-dt)


def _gaussian_logprob(sample: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    lp = -((sample - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def sample(model: UNet2DModel, labels: torch.Tensor, *, seed: int | None = None, seeds: Sequence[int] | None = None,
           steps: int = 10, guidance: float = 1.0, noise_level: float = 0.7, size: int | None = None) -> Trajectory:
    """The SDE sampler from seeded noise -> every step's latent and log-probability (no gradients). `seed`: one
    generator draws the whole batch's noise; `seeds`: each image's own (image i's noise is what `seeds[i]` alone
    draws, so an image does not depend on the batch it is sampled in)."""
    size = size or model.config.sample_size
    shape = (labels.shape[0], 3, size, size)
    if (seed is None) == (seeds is None):
        raise ValueError("sample: give seed (one generator for the batch) or seeds (one per image), not both")
    if seeds is not None:
        if len(seeds) != labels.shape[0]:
            raise ValueError(f"sample: {len(seeds)} seeds for {labels.shape[0]} images")
        gens = [torch.Generator().manual_seed(s) for s in seeds]

        def noise() -> torch.Tensor:
            return torch.cat([torch.randn((1, *shape[1:]), generator=g) for g in gens])
    else:
        gen = torch.Generator().manual_seed(seed)

        def noise() -> torch.Tensor:
            return torch.randn(shape, generator=gen)
    x = noise()
    times = time_grid(steps)
    t_cap = times[1] if steps > 1 else 0.5
    latents, logprobs = [x], []
    with torch.no_grad():
        for t, t_next in zip(times[:-1], times[1:]):
            v = velocity(model, x, t, labels, guidance)
            mean, std = _sde_mean_std(x, v, t, t_next, noise_level, t_cap)
            x = mean + std * noise()
            latents.append(x)
            logprobs.append(_gaussian_logprob(x, mean, std))
    return Trajectory(torch.stack(latents, 1), torch.stack(logprobs, 1), times)


def step_logprobs(model: UNet2DModel, latents: torch.Tensor, labels: torch.Tensor, *, guidance: float = 1.0,
                  noise_level: float = 0.7) -> torch.Tensor:
    """The trainer's side: each recorded step's log-probability under `model` (with gradients) -> (batch, steps)."""
    steps = latents.shape[1] - 1
    times = time_grid(steps)
    t_cap = times[1] if steps > 1 else 0.5
    out = []
    for i, (t, t_next) in enumerate(zip(times[:-1], times[1:])):
        x = latents[:, i]
        v = velocity(model, x, t, labels, guidance)
        mean, std = _sde_mean_std(x, v, t, t_next, noise_level, t_cap)
        out.append(_gaussian_logprob(latents[:, i + 1], mean, std))
    return torch.stack(out, 1)


def save(model: UNet2DModel, path: str | Path) -> None:
    """Save in diffusers' format (config.json + safetensors); `load` reads it back."""
    model.save_pretrained(str(path))


def load(path: str | Path) -> UNet2DModel:
    return UNet2DModel.from_pretrained(str(path)).float().eval()
