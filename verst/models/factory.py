"""The tiny-model factory: a seeded, randomly initialised Hugging Face checkpoint made locally.

`verst model init` calls `init_model`; the folder it writes loads like any downloaded checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verst.models.chat_template import TINY_CHAT_TEMPLATE
from verst.models.tokenizer import EOS_TOKEN, MODEL_MAX_LENGTH, PAD_TOKEN, VOCAB_SIZE, save_tokenizer, special_token_ids

ARCHS = ("qwen3", "qwen3-moe", "llama")
SIZES = ("tiny", "small")

# tiny (~0.5M parameters) is the demo size: 2-digit addition is learnable on 2 CPU cores in minutes.
# small (~4M) is for tasks a tiny model cannot hold. MoE keeps the dense parameter count by giving
# each of the 4 experts a quarter of the dense MLP width.
_DIMS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 512},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 1024},
}
N_EXPERTS = 4
EXPERTS_PER_TOKEN = 2


def model_config(arch: str, size: str, context_length: int = MODEL_MAX_LENGTH) -> Any:
    """The transformers config (Qwen3Config, Qwen3MoeConfig or LlamaConfig) of one arch and size, with room for
    `context_length` tokens."""
    if context_length < 1:
        raise ValueError(f"context_length {context_length}: must be a positive number of tokens")
    if arch not in ARCHS:
        raise ValueError(f"unknown model arch {arch!r}; choices: {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choices: {', '.join(SIZES)}")
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    dims = dict(_DIMS[size])
    ids = special_token_ids()
    common: dict[str, Any] = {
        **dims,
        "head_dim": dims["hidden_size"] // dims["num_attention_heads"],
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": context_length,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": None,
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "dtype": "float32",
    }
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    # Qwen3MoeConfig derives head_dim from hidden_size / heads; every layer is sparse.
    moe = {k: v for k, v in common.items() if k != "head_dim"}
    moe["moe_intermediate_size"] = dims["intermediate_size"] // N_EXPERTS
    return Qwen3MoeConfig(
        **moe, num_experts=N_EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
    )


def init_model(arch: str, size: str, out: str | Path, seed: int = 0, context_length: int = MODEL_MAX_LENGTH) -> Path:
    """Write a complete HF checkpoint (config, safetensors, generation config, tokenizer) to `out`, for contexts
    of up to `context_length` tokens.

    The same (arch, size, seed) gives bit-identical weights; the global torch RNG is left untouched.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = model_config(arch, size, context_length)
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"model output directory {out_dir} is not empty; choose a new --out")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, TINY_CHAT_TEMPLATE, context_length)
    return out_dir


def count_parameters(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
