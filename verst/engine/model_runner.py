"""One forward of any Hugging Face causal LM over a set of KV slots: ragged rows, left-padded, one step.

Builds the inputs (ids, per-row positions, a 4-D additive mask) so that each row attends only to its own
history in the slot cache, and returns the last position's logits per row, plus the routed experts of
every fed token for MoE models (top-k of the router logits, as the model itself picks them). Rows may
name LoRA adapters: their deltas join the one forward (the native forward's own, or hooks on the modules).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import numpy as np
import torch

from verst.engine.config import IMPLS
from verst.engine.kv_cache import SlotKVCache, transformers_slot_cache
from verst.engine.lora import LoraAdapter, LoraBatch
from verst.engine.native import CHECK_TOLERANCE, NativeForward, unsupported_reason
from verst.models.native import NativeCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model's forward and the slot KV cache; knows nothing about requests.

    `impl`: "native" runs `verst.engine.native`'s forward (dense Llama-family models), "transformers"
    the model's own, "auto" native where it applies. On a transformers model the native forward is checked
    against the model's own once (`check`) and refused when they differ; a `NativeCausalLM` (built without
    transformers) has only the native forward, checked by `check_native_model` when asked.
    """

    def __init__(self, model: Any, impl: str = "auto", check: bool = True):
        if impl not in IMPLS:
            raise ValueError(f"model_impl must be one of {list(IMPLS)}, got {impl!r}")
        self.model = model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.num_layers = int(config.num_hidden_layers)
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed past_key_values to cache; older model code still takes the old name
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_last = "logits_to_keep" in params
        self._router_outputs: list[torch.Tensor] = []
        self._lora: LoraBatch | None = None  # the current forward's adapter deltas, read by the module hooks
        self._lora_hooked: set[int] = set()
        self.moe_layers = _hook_routers(model, self._router_outputs)
        self.moe_top_k: int | None = None
        if self.moe_layers:
            if not getattr(config, "num_experts_per_tok", None):
                raise ValueError("MoE model without config.num_experts_per_tok; cannot report routed experts")
            self.moe_top_k = int(config.num_experts_per_tok)
        layer_types = getattr(config, "layer_types", None) or []
        self._sliding_window = getattr(config, "sliding_window", None) if "sliding_attention" in layer_types else None
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        self.native = self._native_forward(impl, check)
        self.impl = "native" if self.native else "transformers"
        self.cache: SlotKVCache = SlotKVCache(self.num_layers) if self.native else transformers_slot_cache(self.num_layers)

    def _native_forward(self, impl: str, check: bool) -> NativeForward | None:
        if isinstance(self.model, NativeCausalLM):
            if impl == "transformers":
                raise ValueError("model_impl 'transformers' needs the model loaded by transformers; this one was built "
                                 "for the native forward (verst.models.native)")
            return NativeForward(self.model)
        reason = unsupported_reason(self.model)
        if impl == "transformers" or (impl == "auto" and reason is not None):
            if impl == "auto":
                log.info("model_impl auto: transformers' forward (native: %s)", reason)
            return None
        native = NativeForward(self.model)  # raises with the reason for an unsupported model
        if check:
            diff = _native_logit_diff(self.model)
            if not diff <= CHECK_TOLERANCE:
                raise RuntimeError(f"the native forward differs from transformers' by {diff:.2e} in logits "
                                   f"(tolerance {CHECK_TOLERANCE:.0e}); use model_impl = 'transformers'")
        return native

    def forward(
        self, first_slot: int, pending: list[list[int]], starts: list[int],
        adapters: list[LoraAdapter | None] | None = None,
    ) -> tuple[torch.Tensor, list[np.ndarray] | None]:
        """Feed `pending[i]` to slot `first_slot + i`, whose first `starts[i]` positions already hold KV,
        under LoRA adapter `adapters[i]` (None: the base model).

        Returns logits of each row's last fed token [batch, vocab] (float32) and, for MoE models, each
        row's routed experts `[len(pending[i]), moe_layers, top_k]` (int32).
        """
        batch = len(pending)
        width_q = max(len(p) for p in pending)
        ids, positions = _left_pad(pending, starts, width_q)  # [batch, seq] each; pads at position -1
        width_kv = max(s + len(p) for s, p in zip(starts, pending))
        self.cache.plan(first_slot, positions, width_kv)
        kwargs: dict[str, Any] = {self._cache_kwarg: self.cache, "use_cache": True}
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        self._router_outputs.clear()
        ids, mask, positions = ids.to(self.device), self._mask(positions, width_kv), positions.clamp(min=0).to(self.device)
        lora = LoraBatch.of(adapters, self.device) if adapters else None
        if self.native is not None:
            last = self.native.forward(ids, positions, mask, self.cache, lora)
        else:
            self._hook_lora(lora)
            try:
                last = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **kwargs).logits[:, -1, :]
            finally:
                self._lora = None
        logits = last.float().cpu()  # sampling runs on the CPU with CPU generators
        experts = None
        if self.moe_top_k:
            experts = self._routed_experts(self._router_outputs, batch, width_q, [len(p) for p in pending])
            self._router_outputs.clear()
        return logits, experts

    def prompt_logprobs(self, ids: list[int], start: int, temperature: float = 1.0) -> list[float | None]:
        """log p(ids[t] | ids[:t]) at temperature `temperature` for t = start .. len(ids) - 1 (None at t = 0,
        which has no context), from one whole-sequence forward of the base model outside the KV cache: the
        prefill that scores a sequence (SGLang's `input_token_logprobs` from `logprob_start_len`)."""
        first = max(start, 1)
        with torch.no_grad():
            x = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, seq]
            kwargs = {} if isinstance(self.model, NativeCausalLM) else {"use_cache": False}
            logits = self.model(input_ids=x, **kwargs).logits[0, first - 1 : -1].float()  # [seq - first, vocab]
            self._router_outputs.clear()
            logprobs = torch.log_softmax(logits / temperature, dim=-1)
            chosen = logprobs.gather(1, x[0, first:, None])[:, 0].cpu().tolist()
        return [None] * (first - start) + chosen

    def _hook_lora(self, lora: LoraBatch | None) -> None:
        """transformers' forward: the adapters' targeted modules add their deltas through forward hooks,
        registered once per module and idle while no forward names an adapter."""
        self._lora = lora
        if lora is None:
            return
        for module in lora.modules():
            if id(module) not in self._lora_hooked:
                module.register_forward_hook(self._add_lora_deltas)
                self._lora_hooked.add(id(module))

    def _add_lora_deltas(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        return None if self._lora is None else self._lora.add_deltas(inputs[0], output, module)

    def probe(self) -> bool:
        """A one-token forward on a scratch cache: does the model still produce finite logits?"""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        if self.native is not None:
            scratch = SlotKVCache(self.num_layers)
            scratch.plan(0, torch.zeros(1, 1, dtype=torch.long), 1)
            logits = self.native.forward(ids, ids, torch.zeros(1, 1, 1, 1, dtype=self.dtype, device=self.device),
                                         scratch)
        else:
            logits = self.model(input_ids=ids, use_cache=False).logits
        self._router_outputs.clear()
        return bool(torch.isfinite(logits).all())

    def _mask(self, positions: torch.Tensor, width: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive mask [batch, 1, seq, width]: query at position p sees kv positions 0..p of its row.

        A large negative value rather than -inf keeps padding queries (which see nothing) free of NaNs.
        """
        kv = torch.arange(width)[None, None, None, :]
        q = positions[:, None, :, None]
        blocked = torch.finfo(self.dtype).min
        full = torch.where(kv <= q, 0.0, blocked).to(device=self.device, dtype=self.dtype)
        if self._sliding_window is None:
            return full
        inside = (kv <= q) & (kv > q - self._sliding_window)
        sliding = torch.where(inside, 0.0, blocked).to(device=self.device, dtype=self.dtype)
        return {"full_attention": full, "sliding_attention": sliding}

    def _routed_experts(
        self, router_outputs: list[torch.Tensor], batch: int, width: int, lengths: list[int]
    ) -> list[np.ndarray]:
        if len(router_outputs) != self.moe_layers:
            raise RuntimeError(f"captured {len(router_outputs)} router outputs, expected {self.moe_layers} MoE layers")
        stacked = torch.stack([r.reshape(batch, width, -1) for r in router_outputs], dim=2)  # [b, seq, layers, *]
        if not stacked.dtype.is_floating_point:  # the routers' own choices
            chosen = stacked.to(torch.int32).cpu().numpy()
        else:  # router logits: their top-k
            chosen = stacked.topk(self.moe_top_k, dim=-1).indices.to(torch.int32).cpu().numpy()
        return [chosen[i, width - n :] for i, n in enumerate(lengths)]


def check_native_model(model: NativeCausalLM, reference: Any) -> float:
    """Max |logit difference| between a `NativeCausalLM` and `reference`, transformers' model of the same
    checkpoint; raises when it exceeds the tolerance (`verst serve engine --check-native`)."""
    diff = _logit_diff(ModelRunner(model, impl="native"), ModelRunner(reference, impl="transformers"))
    if not diff <= CHECK_TOLERANCE:
        raise RuntimeError(f"the native model differs from transformers' by {diff:.2e} in logits "
                           f"(tolerance {CHECK_TOLERANCE:.0e}); use model_impl = 'transformers'")
    return diff


def _native_logit_diff(model: Any) -> float:
    """Max |logit difference| between the native forward and transformers' on one transformers model."""
    return _logit_diff(ModelRunner(model, impl="native", check=False), ModelRunner(model, impl="transformers"))


def _logit_diff(native: ModelRunner, reference: ModelRunner) -> float:
    """Max |logit difference| of two runners over a ragged prefill and a decode step (each runner has a
    scratch cache of its own)."""
    vocab = int(native.model.get_input_embeddings().num_embeddings)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 2, 7)]
    worst = 0.0
    with torch.no_grad():
        for pending, starts in ((prompts, [0, 0, 0]), ([[1], [2], [3]], [len(p) for p in prompts])):
            ours, _ = native.forward(0, pending, starts)
            theirs, _ = reference.forward(0, pending, starts)
            worst = max(worst, float((ours - theirs).abs().max()))
    return worst


def _left_pad(pending: list[list[int]], starts: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and absolute positions [batch, width]; each row right-aligned, padding at position -1.

    Left padding puts every row's last token in the last column, so the model computes logits for one
    column only (`logits_to_keep=1`).
    """
    if width == 1:
        ids = torch.tensor([p[0] for p in pending])[:, None]
        return ids, torch.tensor(starts)[:, None]
    ids_rows, pos_rows = [], []
    for tokens, start in zip(pending, starts):
        pad = width - len(tokens)
        ids_rows.append([0] * pad + tokens)
        pos_rows.append([-1] * pad + list(range(start, start + len(tokens))))
    return torch.tensor(ids_rows), torch.tensor(pos_rows)


def _hook_routers(model: Any, sink: list[torch.Tensor]) -> int:
    """Record what every MoE router chose into `sink` during forwards; returns the number of routers.

    transformers declares where router logits come from (`_can_record_outputs["router_logits"]`); hooking
    those modules directly avoids `output_router_logits=True`, whose auxiliary loss cannot take a 4-D mask.
    A router returning `(logits, weights, indices)` (Qwen3-MoE's) is recorded by its indices, the experts
    its layer ran, even where two experts' probabilities tie in float32 while their logits do not; other
    routers by their logits, whose top-k is then the choice of a softmax top-k router.
    """
    spec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        return 0
    target = getattr(spec, "target_class", spec)
    index = getattr(spec, "index", 0)
    routers = [m for m in model.modules() if isinstance(target, type) and isinstance(m, target)]

    def record(module: Any, inputs: Any, output: Any) -> None:
        if isinstance(output, (tuple, list)):
            sink.append(output[2] if len(output) == 3 else output[index])
        else:
            sink.append(output)

    for module in routers:
        module.register_forward_hook(record)
    return len(routers)
