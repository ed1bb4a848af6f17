"""Which `config.json` the native model class (`verst.models.native`) covers, read without torch: the
engine and trainer choose their model class with it, and start-up checks (preflight) refuse modes needing it.
"""

from __future__ import annotations

from typing import Any

NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def native_config_reason(config: dict[str, Any]) -> str | None:
    """Why a `config.json` cannot be built as a `NativeCausalLM` (None when it can)."""
    model_type = config.get("model_type")
    if model_type not in NATIVE_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {list(NATIVE_MODEL_TYPES)}"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')!r} (only silu)"
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        return "sliding-window attention"
    if model_type == "mistral" and config.get("sliding_window"):
        return f"sliding_window {config['sliding_window']}"
    theta = rope_settings(config)
    if isinstance(theta, str):
        return theta
    if config.get("pretraining_tp", 1) != 1:
        return f"pretraining_tp {config['pretraining_tp']}"
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if k not in config]
    if missing:
        return f"config.json lacks {missing}"
    return None


def rope_settings(config: dict[str, Any]) -> float | str:
    """The rope base (theta) of plain rotary embeddings, or why the config's rope is not plain."""
    params = config.get("rope_parameters") or {}  # transformers 5.x; earlier configs: rope_theta / rope_scaling
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        return f"rope_type {kind!r} (only default rotary embeddings)"
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        return f"partial_rotary_factor {factor}"
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
