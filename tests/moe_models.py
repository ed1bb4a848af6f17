"""A tiny Qwen3-MoE whose routers sit near ties: every expert's router row is the same row plus a
perturbation of 1e-6 of its scale, so float32 rounding differences between the engine's batched KV-cache
forward and the trainer's whole-sequence forward flip which experts a token gets (a real routing
mismatch between two forwards of the same weights)."""

from pathlib import Path

import torch

from verst.models.factory import init_model


def near_tie_moe(out: Path, seed: int = 3) -> Path:
    from verst.models.loader import load_model

    path = init_model("qwen3-moe", "tiny", out, seed=seed)
    model = load_model(path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.mlp.gate.weight  # [experts, hidden]
            noise = torch.randn(weight.shape, generator=generator)
            weight.copy_(weight[0:1] + 1e-6 * noise * weight.abs().mean())
    model.save_pretrained(path)
    return path
