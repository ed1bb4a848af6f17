"""PEFT LoRA adapters for a tiny model, made for the engine's LoRA tests: random non-zero A and B, so an
adapter changes the model's outputs, saved as PEFT saves them (adapter_config.json + safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_adapter(model_dir: Path, out: Path, seed: int, target_modules: Any = "all-linear", r: int = 4,
                 alpha: int = 8, **config: Any) -> Any:
    """Save a LoRA adapter of the model at `model_dir` into `out`; returns the PeftModel (eval mode), the
    reference its outputs are compared with. B is scaled up so that the adapter moves logits visibly."""
    from peft import LoraConfig, get_peft_model

    from verst.models.loader import load_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0,
                      init_lora_weights=False, **config)
    peft_model = get_peft_model(load_model(model_dir), lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(out)
    return peft_model.eval()


def reference_logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """log_softmax of one full-sequence forward of `model`, at the positions that produced `output`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]
