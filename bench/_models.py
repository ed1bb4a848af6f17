"""The benches' `--model` option: `smollm2` (SmolLM2-135M-Instruct, from $VERST_SMOLLM2 or converted once
into the user's cache, as the slow tests get it), a real model's shape with random weights
(`smollm2-135m-shape`, `qwen3-0.6b-shape`: its layers, widths and heads, with the tiny models' byte
tokenizer and vocabulary, so no download; `smollm2-135m-8-heads-vocab-shape` at SmolLM2's vocabulary, whose ids
the byte tokenizer never produces), or the path of any Hugging Face checkpoint directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

KNOWN = ("smollm2",)
# The bodies of two real models (their config.json), at the tiny tokenizer's vocabulary.
SHAPES = {
    "smollm2-135m-shape": ("llama", {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}),
    # SmolLM2-135M's body with 8 query and 4 KV heads of 72 (the same width): its 9 and 3 heads do not split in 2
    "smollm2-135m-8-heads-shape": ("llama", {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                                             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 72}),
    # the same, at SmolLM2's own 49,152-token vocabulary with its tied embeddings (28M of its parameters)
    "smollm2-135m-8-heads-vocab-shape": ("llama", {"hidden_size": 576, "intermediate_size": 1536,
                                                   "num_hidden_layers": 30, "num_attention_heads": 8,
                                                   "num_key_value_heads": 4, "head_dim": 72, "vocab_size": 49152,
                                                   "tie_word_embeddings": True}),
    "qwen3-0.6b-shape": ("qwen3", {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}),
}


def resolve_model(spec: str) -> Path:
    if spec == "smollm2":
        from tests.real_model import smollm2_checkpoint

        return smollm2_checkpoint()
    if spec in SHAPES:
        return shaped_model(spec, Path(tempfile.mkdtemp(prefix=f"verst-{spec}-")))
    path = Path(spec)
    if not (path / "config.json").exists():
        raise SystemExit(f"--model {spec}: neither one of {KNOWN + tuple(SHAPES)} nor a checkpoint directory with a "
                         "config.json")
    return path


def shaped_model(name: str, out: Path) -> Path:
    """A checkpoint of `name`'s shape with seeded random weights (bfloat16 on disk, half the bytes), built on
    the GPU when there is one (initialising 0.6B parameters on the CPU takes most of a minute)."""
    import torch
    from transformers import AutoModelForCausalLM

    from verst.models.factory import init_model, model_config

    arch, dims = SHAPES[name]
    tiny = init_model(arch, "tiny", out / "tiny", seed=0)  # its tokenizer files, and the config to widen
    config = model_config(arch, "tiny")
    for key, value in {**dims, "max_position_embeddings": 4096}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = out / name
    model.save_pretrained(path)
    for file in tiny.iterdir():
        if file.name != "config.json" and not file.name.endswith(".safetensors"):
            (path / file.name).write_bytes(file.read_bytes())
    return path
