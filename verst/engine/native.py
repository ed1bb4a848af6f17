"""A hand-written forward for the dense Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) on the
engine's slot KV cache.

transformers' forward spends most of a small model's decode step in Python (module calls, mask and
cache bookkeeping); this one runs the same arithmetic with the model's own weights as a straight list of
tensor ops: RMSNorm, the q/k/v projections (with Qwen3's per-head q/k norms), the model's rotary
embedding, grouped-query attention under the runner's additive mask, the SiLU-gated MLP, and the final
norm and head on each row's last column only. Weights are read from the modules at every call, so
in-place weight loads apply at once; LoRA adapters add their per-row deltas to every linear they target. `ModelRunner` compares it with transformers on a ragged batch
and refuses to use it when they differ.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from verst.engine.kv_cache import SlotKVCache
from verst.engine.lora import LoraBatch
from verst.models.native import linear as _base_linear
from verst.models.native import rms_norm as _rms_norm
from verst.models.native import rope as _rope

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
CHECK_TOLERANCE = 1e-4  # max |logit difference| against transformers on the check batch (float32: ~1e-6)


def unsupported_reason(model: Any) -> str | None:
    """Why the native forward cannot run `model`, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {list(MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return "sliding-window attention"
    if getattr(config, "sliding_window", None) and model_type == "mistral":
        return f"sliding_window {config.sliding_window}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no model.layers / model.rotary_emb (not a transformers Llama-family layout)"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a layer without self_attn.{q,k,v,o}_proj"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a layer without mlp.{gate,up,down}_proj"
    return None


class NativeForward:
    """`forward(ids, positions, mask, cache)` → last-column logits, as transformers computes them."""

    def __init__(self, model: Any):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the native forward cannot run this model: {reason}")
        self.model = model
        self.inner = model.model
        config = model.config
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.scaling = float(getattr(self.inner.layers[0].self_attn, "scaling", self.head_dim**-0.5))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: SlotKVCache,
                lora: LoraBatch | None = None) -> torch.Tensor:
        """ids, positions [batch, seq] (padding at position 0 with a fully blocking mask row), mask
        [batch, 1, seq, width] additive; returns [batch, vocab] logits of the last column. `lora`: the
        adapter deltas of the rows that name an adapter."""
        _linear = _base_linear if lora is None else lora.linear
        batch, seq = ids.shape
        h = self.inner.embed_tokens.weight[ids]
        cos, sin = self.inner.rotary_emb(h, positions)  # [batch, seq, head_dim]
        cos, sin = cos[:, None], sin[:, None]
        groups = self.num_heads // self.num_kv_heads
        grouped_mask = mask[:, :, None]  # [batch, 1, 1, seq, width]
        for index, layer in enumerate(self.inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(h, layer.input_layernorm)
            q = _linear(x, attn.q_proj).view(batch, seq, self.num_heads, self.head_dim)
            k = _linear(x, attn.k_proj).view(batch, seq, self.num_kv_heads, self.head_dim)
            v = _linear(x, attn.v_proj).view(batch, seq, self.num_kv_heads, self.head_dim)
            if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head
                q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, heads, seq, dim]
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            keys, values = cache.update(k, v, index)  # [batch, kv_heads, width, dim]
            # Grouped-query attention as plain batched matmuls: the query heads sharing a KV head are
            # stacked along the query axis, so K and V are used as stored, never repeated or broadcast.
            q = q.reshape(batch, self.num_kv_heads, groups * seq, self.head_dim)
            scores = (q @ keys.transpose(-1, -2)).view(batch, self.num_kv_heads, groups, seq, -1)
            scores = scores * self.scaling + grouped_mask
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = probs.view(batch, self.num_kv_heads, groups * seq, -1) @ values  # [batch, kv_heads, groups*seq, dim]
            out = out.view(batch, self.num_heads, seq, self.head_dim).transpose(1, 2).reshape(batch, seq, -1)
            h = h + _linear(out, attn.o_proj)
            x = _rms_norm(h, layer.post_attention_layernorm)
            h = h + _linear(F.silu(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj), mlp.down_proj)
        last = _rms_norm(h[:, -1], self.inner.norm)
        return _linear(last, self.model.lm_head)
