"""The diffusion engine's `/generate` in SGLang's shape, both ends: the request (a class description in
`text`, the image settings in `sampling_params`), the reply per image, and the arrays it carries as base64
of float32 C-order bytes with their shape (an exact round trip). Imports numpy, not torch.

sglang-router 0.3.2 forwards only the `sampling_params` SGLang knows: `sampling_seed` and `n` reach an
engine behind it, `num_inference_steps`, `guidance_scale` and `noise_level` are dropped, so there the
engine's launch settings (`--num-inference-steps`, ...) apply. Every reply states the settings it was sampled
with, and `ImageResult.check` refuses a reply whose settings differ from the request's, so a dropped setting is
an error, never a silent default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from verst.inference_client.protocol import (
    GENERATE_DEFAULT_ONLY,
    GENERATE_IGNORED,
    InvalidRequest,
    WireModel,
    without_hints,
)
from verst.types import arrays

MAX_IMAGES = 64  # images of one request (`n`)
MAX_STEPS = 1000
SETTINGS = ("num_inference_steps", "guidance_scale", "noise_level")  # echoed in every reply's meta_info
# Fields sglang-router 0.3.2 adds to every forwarded /generate body, accepted at the values it sends.
_ROUTER_DEFAULTS: dict[str, tuple[Any, ...]] = {
    **GENERATE_DEFAULT_ONLY, "return_text_in_logprobs": (False,), "stream": (False,),
}


class ImageSamplingParams(WireModel):
    """`sampling_params` of an image request: the SDE sampler's settings (`verst.models.diffusion.sample`)."""

    error_prefix: ClassVar[str] = "sampling_params."

    sampling_seed: int | None = Field(None, ge=0, le=2**62, description="The first image's seed (image i: seed + i); "
                                      "None: the engine's --seed.")
    num_inference_steps: int = Field(10, ge=1, le=MAX_STEPS, description="SDE steps from noise (t = 1) to the image.")
    guidance_scale: float = Field(1.0, ge=0.0, le=100.0, description="Classifier-free guidance; 1: none.")
    noise_level: float = Field(0.7, gt=0.0, le=10.0, description="The SDE's a: σ_t = a·√(t / (1 − t)).")
    n: int = Field(1, ge=1, le=MAX_IMAGES, description="Images from one request, seeds sampling_seed + i.")


class ImageGenerateRequest(WireModel):
    """`POST /generate` of the diffusion engine: one class description, `n` images."""

    accepted_only_at: ClassVar[dict[str, tuple[Any, ...]]] = _ROUTER_DEFAULTS
    accepted_and_ignored: ClassVar[tuple[str, ...]] = GENERATE_IGNORED

    text: str = Field(..., min_length=1, description="The class to draw, e.g. 'red circle'.")
    sampling_params: ImageSamplingParams = Field(default_factory=ImageSamplingParams)
    return_logprob: bool = Field(False, description="Return every step's latent and log-probability (training).")
    rid: str | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _router_fields(cls, data: Any) -> Any:
        return without_hints(data, _ROUTER_DEFAULTS)


def decode_array(encoded: dict[str, Any], field: str = "image") -> np.ndarray:
    """`verst.types.arrays.decode_array`, refused as a bad request naming `field`."""
    try:
        return arrays.decode_array(encoded, field)
    except ValueError as exc:
        raise InvalidRequest(field, _short(encoded), str(exc).removeprefix(f"{field}: ")) from None


def _short(value: Any) -> Any:
    return {k: v for k, v in value.items() if k != "data"} if isinstance(value, dict) else type(value).__name__


@dataclasses.dataclass
class ImageResult:
    """One image of a reply: the class id the engine drew (`label`), the image (3, H, W) in [-1, 1]; with `return_logprob`, the latents
    (steps + 1, 3, H, W) from the start noise to the unclamped image and each step's log-probability (steps,)."""

    rid: str
    seed: int
    label: int
    weight_version: str
    finish_reason: dict[str, Any]
    settings: dict[str, Any]
    image: np.ndarray | None
    latents: np.ndarray | None = None
    logprobs: np.ndarray | None = None

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> ImageResult:
        meta = reply["meta_info"]
        latents = meta.get("latents")
        logprobs = meta.get("step_logprobs")
        return cls(
            rid=meta["id"], seed=meta["seed"], label=meta["label"], weight_version=meta["weight_version"],
            finish_reason=meta["finish_reason"], settings={k: meta[k] for k in SETTINGS},
            image=decode_array(reply["image"]) if reply.get("image") is not None else None,
            latents=decode_array(latents, "latents") if latents is not None else None,
            logprobs=np.asarray(logprobs, dtype=np.float32) if logprobs is not None else None,
        )

    def check(self, sampling_params: dict[str, Any]) -> ImageResult:
        """Refuse a reply sampled with other settings than asked for (a router that dropped them)."""
        for name in SETTINGS:
            if name in sampling_params and sampling_params[name] != self.settings[name]:
                raise InvalidRequest(f"sampling_params.{name}", sampling_params[name],
                                     f"the engine sampled with {self.settings[name]!r}: something between "
                                     "(sglang-router 0.3.2 drops it) did not pass it on")
        return self


def image_replies(body: Any) -> list[dict[str, Any]]:
    """A /generate reply as a list: one reply for n = 1, SGLang's list for n > 1."""
    return body if isinstance(body, list) else [body]
