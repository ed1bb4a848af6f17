"""A test helper: write a Hugging Face Llama checkpoint as a float32 GGUF file with the `gguf` package,
in llama.cpp's layout (tensor names, the rotary permutation of q and k, a gpt2-style tokenizer), so the
GGUF import is tested on a small file whose original weights are known."""

import json
from pathlib import Path

import numpy as np
import torch

NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of q/k rows (transformers' GGUF loader undoes it)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(name: str) -> str:
    if name in NAMES:
        return NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def write_llama_gguf(model_dir: Path, out: Path) -> Path:
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out), "llama")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    vocab = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # control / normal
    writer.add_token_merges(tokenizer["model"].get("merges") or [])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_bos_token_id(config.get("bos_token_id") or config["eos_token_id"])
    state = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in state.items():
        array = tensor.to(torch.float32).numpy()
        if name.endswith("self_attn.q_proj.weight"):
            array = permute(array, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = permute(array, kv_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
