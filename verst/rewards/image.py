"""Rewards on images (float tensors (N, 3, H, W) in [-1, 1]) for diffusion RL.

- `jpeg_compressibility`: DDPO's (Black et al. 2023, arXiv:2305.13301): minus the JPEG size in kilobytes.
- `ShapeClassifier`: a small CNN trained on the procedural shapes dataset; `alignment` rewards the
  probability it gives the prompt's class, and `accuracy` counts its argmax agreeing with the prompt.
- The RL run's reward fns on an image trajectory's sample (its final latent, its class id the prompt token):
  `shape_alignment` (registered as "shape_alignment", built from the classifier's file) and `jpeg_reward`.
"""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from verst.rewards.values import RewardError
from verst.types import Sample
from verst.types.arrays import decode_array


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) in [-1, 1] -> (N, H, W, 3) uint8."""
    return ((images.detach().clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()


def jpeg_compressibility(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """Minus each image's JPEG size in kB: smaller files score higher."""
    sizes = []
    for array in to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(-buffer.tell() / 1000.0)
    return torch.tensor(sizes)


class ShapeClassifier(torch.nn.Module):
    """A small CNN over (3, size, size) images -> logits over the shapes dataset's classes."""

    def __init__(self, n_classes: int):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(128, n_classes),
        )
        self.n_classes = n_classes

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def fit(self, images: torch.Tensor, labels: torch.Tensor, *, steps: int = 1000, batch_size: int = 64,
            seed: int = 0) -> float:
        """Train on labelled images -> the final training accuracy."""
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(self.parameters(), lr=3e-3)
        for _ in range(steps):
            idx = torch.randint(0, images.shape[0], (batch_size,), generator=gen)
            loss = torch.nn.functional.cross_entropy(self(images[idx]), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        self.eval()
        with torch.no_grad():
            return (self(images).argmax(1) == labels).float().mean().item()

    @torch.no_grad()
    def alignment(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The probability of the prompt's class, per image."""
        return self(images).softmax(1).gather(1, labels[:, None])[:, 0]

    @torch.no_grad()
    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        return (self(images).argmax(1) == labels).float().mean().item()

    def save(self, path: str | Path) -> None:
        torch.save({"n_classes": self.n_classes, "state": self.state_dict()}, path)

    @classmethod
    def load(cls, path: str | Path) -> ShapeClassifier:
        saved = torch.load(path, weights_only=True)
        model = cls(int(saved["n_classes"]))
        model.load_state_dict(saved["state"])
        return model.eval()


def sample_image(sample: Sample) -> torch.Tensor:
    """An image trajectory's image (3, H, W) in [-1, 1]: its last latent, clamped (what the engine returned)."""
    if sample.latents is None:
        raise RewardError(f"sample {sample.index}: no latents; an image reward scores image trajectories "
                          "(model.kind = 'diffusion')")
    return torch.from_numpy(decode_array(sample.latents, "latents")[-1]).clamp(-1, 1)


def shape_alignment(classifier_path: str) -> Callable[[Sample], Awaitable[dict[str, float]]]:
    """The reward fn of the classifier at `classifier_path`: {"alignment": its probability of the sample's
    class (the prompt token), "correct": 1.0 when that class is its choice}."""
    classifier = ShapeClassifier.load(classifier_path)

    async def reward(sample: Sample) -> dict[str, float]:
        image, label = sample_image(sample)[None], torch.tensor([sample.tokens[0]])
        if not 0 <= int(label) < classifier.n_classes:
            raise RewardError(f"sample {sample.index}: class {int(label)} is not one of the classifier's "
                              f"{classifier.n_classes}")
        with torch.no_grad():
            probs = classifier(image).softmax(1)[0]
        return {"alignment": float(probs[label]), "correct": float(int(probs.argmax()) == int(label))}

    return reward


async def jpeg_reward(sample: Sample) -> float:
    """Minus the sample's image's JPEG size in kB."""
    return float(jpeg_compressibility(sample_image(sample)[None])[0])
