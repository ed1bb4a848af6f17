"""The loss's plug-in points by import path: a mismatch correction, a per-token policy loss and a loss
reducer (`algorithm.mismatch_fn`, `policy_loss_fn`, `loss_reducer`), their signatures, and their loading.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Protocol

import torch

from verst.config import AlgorithmConfig, ConfigError, load_object


class MismatchFn(Protocol):
    """`algorithm.mismatch_fn`: `(old_logprobs, rollout_logprobs, loss_mask, *, clip_low, clip_high) ->
    (weights, flags)`, like `verst.algo.mismatch_weights` without the mode. Inputs and outputs are
    [batch, resp_len]; `weights` multiply each token's policy loss (detached by the caller), `flags`
    (bool) mark the tokens the correction rejected (`train/mis_reject_frac`). `clip_low`, `clip_high`
    are `algorithm.tis_clip_low`, `algorithm.tis_clip`."""

    def __call__(
        self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
        clip_low: float, clip_high: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip


class PolicyLossFn(Protocol):
    """`algorithm.policy_loss_fn`: `(logprobs, old_logprobs, advantages, loss_mask, cfg) -> (token_loss,
    clipped)`, like `verst.algo.policy_loss.policy_token_loss`. Tensors are [batch, resp_len]; `logprobs`
    carries the gradient, `cfg` is the `AlgorithmConfig`. `token_loss` is the loss of each token (to be
    minimised; masked positions are ignored), `clipped` (bool) the tokens counted in `train/pg_clipfrac`.
    Mismatch weights, OPSM, the KL, entropy and other terms and the reduction are applied around it."""

    def __call__(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
        cfg: AlgorithmConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip


class LossReducer(Protocol):
    """`algorithm.loss_reducer`: `(token_values, loss_mask, aggregation) -> loss`, like
    `verst.algo.aggregate`: per-token values [batch, resp_len] to a 0-d tensor, applied to every term
    of the loss. The result is this micro-batch's mean over the units of `aggregation`
    (`algorithm.loss_aggregation`): verst rescales it by the units' local count over their global count
    (`aggregation_normalizer`), so micro-batches add up to the global batch's loss."""

    def __call__(self, token_values: torch.Tensor, loss_mask: torch.Tensor, aggregation: str) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class LossPlugins:
    """The loaded plug-ins of one `AlgorithmConfig`; None where the built-in applies."""

    mismatch_fn: MismatchFn | None = None
    policy_loss_fn: PolicyLossFn | None = None
    loss_reducer: LossReducer | None = None


# field -> (positional arguments it is called with, keyword arguments, the documented signature)
_SIGNATURES: dict[str, tuple[int, tuple[str, ...], str]] = {
    "mismatch_fn": (
        3,
        ("clip_low", "clip_high"),
        "def fn(old_logprobs, rollout_logprobs, loss_mask, *, clip_low, clip_high) -> (weights, flags)",
    ),
    "policy_loss_fn": (5, (), "def fn(logprobs, old_logprobs, advantages, loss_mask, cfg) -> (token_loss, clipped)"),
    "loss_reducer": (3, (), "def fn(token_values, loss_mask, aggregation) -> loss"),
}


def check_loss_plugin(fn: Any, field: str, path: str) -> Any:
    """Return `fn` if it can be called as `algorithm.<field>` is, else raise ConfigError naming field and path."""
    n_args, keywords, signature = _SIGNATURES[field]
    where = f"algorithm.{field} = {path!r}"
    if inspect.isclass(fn) or not callable(fn):
        raise ConfigError(f"{where} is a {type(fn).__name__}, not a function; expected `{signature}`")
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise ConfigError(f"{where} is an async function; the loss runs in the train step: expected `{signature}`")
    try:
        inspect.signature(fn).bind(*range(n_args), **dict.fromkeys(keywords, 0))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} cannot be called as `{signature}` ({e})") from None
    return fn


@functools.lru_cache(maxsize=16)
def _load(field: str, path: str) -> Any:
    return check_loss_plugin(load_object(path, f"algorithm.{field}"), field, path)


def load_loss_plugins(cfg: AlgorithmConfig) -> LossPlugins:
    """Import and check each plug-in `cfg` names (once per path and process); errors name the field and path."""
    return LossPlugins(
        **{field: _load(field, getattr(cfg, field)) for field in _SIGNATURES if getattr(cfg, field) is not None}
    )
