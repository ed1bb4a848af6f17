"""Rollout routing replay (R3) for MoE: the trainer's routers take the experts the engine chose for each
token instead of their own top-k, and the share of choices where their own top-k disagrees is counted.

The rule at a replayed token (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training
and Inference Routers"): the experts are the engine's; their weights are the router's own softmax over all
experts at the trainer's logits, read at those experts and, with `norm_topk_prob`, divided by their sum
(`replay_weights`), so gradients still reach the router. Where the two agree this is bit for bit what the
router computes itself. Positions without a recorded choice (padding, each sequence's last token, whose
logits no loss reads) keep the router's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

ROUTING_MODES = ("off", "measure", "replay")


def replay_weights(router_logits: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """The routing weights [tokens, top_k] of `experts` [tokens, top_k] (int64) under `router_logits`
    [tokens, n_experts]: softmax in float32, gathered at `experts`, renormalised over them when
    `norm_topk_prob`, cast back to the logits' dtype (as Qwen3-MoE's router does for its own top-k)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


def choice_mismatches(own: torch.Tensor, recorded: torch.Tensor) -> tuple[int, int]:
    """(choices of `recorded` [tokens, top_k] missing from `own` [tokens, top_k], all choices): the
    token-expert choices where two routers disagree, order within a token ignored."""
    if recorded.numel() == 0:
        return 0, 0
    found = (recorded[:, :, None] == own[:, None, :]).any(-1)  # [tokens, top_k]
    return int((~found).sum()), int(found.numel())


class RoutingReplay:
    """Forward hooks on every MoE router of `model` (a transformers MoE whose routers return
    `(logits, weights, indices)` and carry `norm_topk_prob`, as Qwen3-MoE's). `recorded` sets the next
    forwards' engine choices [rows, width, moe_layers, top_k] (-1: none), aligned with the input ids, or
    None; they stay set for the backward's recomputation under activation checkpointing."""

    def __init__(self, model: Any, replay: bool):
        self.replay = replay
        self.routers = _routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router; routing replay needs an MoE model")
        for layer, router in enumerate(self.routers):
            if not hasattr(router, "norm_topk_prob"):
                raise ValueError(f"{type(router).__name__} has no norm_topk_prob; its routing weights cannot be "
                                 "recomputed at replayed experts")
            router.register_forward_hook(self._hook(layer))
        self.recorded: torch.Tensor | None = None  # [tokens, moe_layers, top_k]
        self.counting = False
        self.mismatched = self.total = 0

    @contextlib.contextmanager
    def forward(self, recorded: torch.Tensor | None) -> Iterator[None]:
        """One forward under `recorded` choices; disagreements are counted during the forward only."""
        self.recorded = None if recorded is None else recorded.reshape(-1, *recorded.shape[2:])
        self.counting = True
        try:
            yield
        finally:
            self.counting = False

    def check_items(self, items: list[Any]) -> None:
        """With replay, every train item carries the engine's expert choices; refused naming the first that do not."""
        missing = [it.index for it in items if it.routed_experts is None] if self.replay else []
        if missing:
            raise ValueError(f"algorithm.routing_replay = 'replay': train items {missing[:5]} carry no routed_experts "
                             "(the generate fn records them on the samples when the run asks the engines for them)")

    def take_counts(self) -> tuple[int, int]:
        """(mismatched, total) choices counted since the last call."""
        counts, (self.mismatched, self.total) = (self.mismatched, self.total), (0, 0)
        return counts

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, inputs: Any, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Any:
            if self.recorded is None:
                return None
            logits, weights, indices = output
            chosen = self.recorded[:, layer].to(indices.device)  # [tokens, top_k]
            if chosen.shape != indices.shape:
                raise ValueError(f"routing replay: MoE layer {layer} routes {tuple(indices.shape)} (tokens, top_k); "
                                 f"the recorded experts are {tuple(chosen.shape)}")
            valid = chosen[:, 0] >= 0  # [tokens]
            if self.counting:
                bad, total = choice_mismatches(indices[valid], chosen[valid])
                self.mismatched, self.total = self.mismatched + bad, self.total + total
            if not self.replay:
                return None
            experts = torch.where(valid[:, None], chosen.to(indices.dtype), indices)
            replayed = replay_weights(logits, experts, bool(module.norm_topk_prob))
            return logits, torch.where(valid[:, None], replayed, weights), experts

        return hook


def mismatch_rate(counts: list[tuple[int, int]]) -> dict[str, float]:
    """`train/routing_mismatch_rate`: the share of recorded token-expert choices the policy's own routers did not
    make, from ranks' (mismatched, total) counts; {} when nothing was counted."""
    mismatched, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return {"train/routing_mismatch_rate": mismatched / total} if total else {}


def _routers(model: Any) -> list[Any]:
    """The router modules, in layer order: where transformers records router logits from
    (`_can_record_outputs["router_logits"]`), as the engine does when it records routed experts."""
    for candidate in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        spec = (getattr(candidate, "_can_record_outputs", None) or {}).get("router_logits")
        if spec is not None:
            target = getattr(spec, "target_class", spec)
            return [m for m in model.modules() if isinstance(target, type) and isinstance(m, target)]
    return []
