"""LoRA on the trainer's model with PEFT: which linear layers get adapters (checked by name), what weight
sync sends (the adapter's tensors and config, or the merged weights), and the exports (adapter, merged model).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from verst.config.schema import LoraConfig, TrainerConfig
from verst.trainer import persistence
from verst.trainer.backend import MERGED_LORA_DIR
from verst.trainer.optim import lr_factor

ADAPTER = "default"  # PEFT's adapter name; one adapter per model
_ADAPTER_PART = re.compile(r"(^|\.)lora_")  # lora_A, lora_B, lora_dropout, ...: adapter modules, not base ones


def add_adapters(model: torch.nn.Module, cfg: LoraConfig, adapters: dict[str, LoraConfig] | None = None,
                 ) -> torch.nn.Module:
    """`model` (native or transformers) as a PEFT model with fresh adapters (B = 0: the base's outputs),
    every base parameter frozen. A target that names no linear layer of the model is refused by name.
    `adapters` (multi-LoRA): one PEFT adapter per name, each with its own settings, every one trainable
    (the one active in a forward is the one that gets gradients); else one adapter, `ADAPTER`."""
    from peft import get_peft_model

    if not adapters:
        return get_peft_model(model, _peft_config(model, cfg))
    configs = {name: _peft_config(model, adapter_cfg) for name, adapter_cfg in adapters.items()}  # on the bare model
    (first, first_config), *rest = configs.items()
    peft_model = get_peft_model(model, first_config, adapter_name=first)
    for name, config in rest:
        peft_model.add_adapter(name, config)
    for name, parameter in peft_model.named_parameters():
        if _ADAPTER_PART.search(name):
            parameter.requires_grad_(True)  # add_adapter leaves the added adapters frozen
    return peft_model


def _peft_config(model: torch.nn.Module, cfg: LoraConfig) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    targets = target_modules(model, cfg.target_modules)
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                          bias="none")


def adapter_parameters(model: torch.nn.Module, adapter: str) -> list[torch.nn.Parameter]:
    """The parameters of one named adapter (its lora_A and lora_B of every targeted layer)."""
    parts = (f".lora_A.{adapter}.", f".lora_B.{adapter}.")
    params = [p for name, p in model.named_parameters() if any(part in name for part in parts)]
    if not params:
        raise ValueError(f"the model has no parameters of adapter {adapter!r}")
    return params


def activate(model: torch.nn.Module, adapter: str) -> None:
    """Make `adapter` the one PEFT's forward applies. PEFT's `set_adapter` also freezes the others; they stay
    trainable here (their parameters only get no gradient while inactive), so FSDP2 and the optimizer see
    the same trainable set at every step."""
    model.set_adapter(adapter)
    for name, parameter in model.named_parameters():
        if _ADAPTER_PART.search(name):
            parameter.requires_grad_(True)


def target_modules(model: torch.nn.Module, wanted: list[str] | str) -> list[str]:
    """The names PEFT gets: each wanted name (a module's full name or its last part) checked against the
    model's linear layers; `all-linear`: the last parts of every linear layer but the output head. A tied
    output head is refused: its weight is the embedding's, which the engines would see merged twice."""
    linear = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    head_name = next((name for name, module in linear.items() if module is head), None)
    if wanted == "all-linear":
        names = sorted({name.rpartition(".")[2] for name in linear if name != head_name})
        if not names:
            raise ValueError(f"lora.target_modules = 'all-linear': the model ({type(model).__name__}) has no "
                             "linear layer besides its output head")
        return names
    for name in wanted:
        matches = [m for m in linear if m == name or m.endswith("." + name)]
        if not matches:
            leaves = sorted({m.rpartition(".")[2] for m in linear})
            raise ValueError(f"lora.target_modules: {name!r} names no linear layer of the model "
                             f"({type(model).__name__}); its linear layers end in {leaves}")
        tied = getattr(model.config, "tie_word_embeddings", False)
        if head_name in matches and tied:
            raise ValueError(f"lora.target_modules: {name!r} names the output head {head_name!r}, whose weight is "
                             "tied to the input embedding; leave it out")
    return list(wanted)


def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective. The base's tensors under its own names (as `persistence.named_tensors` names them without
    PEFT), each adapted weight as W + B·A · scale; the adapters are not among them and the model is not
    changed. Full tensors (gathered from the shards), on the parameters' device."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    for name, tensor in persistence.named_tensors(base):
        if _ADAPTER_PART.search(name):
            continue
        owner, _, leaf = name.rpartition(".")
        full = _full(tensor)
        if owner.endswith(".base_layer"):
            owner = owner.removesuffix(".base_layer")
            if leaf == "weight":
                full = full + delta_weight(layers[owner], _full)
        yield (f"{owner}.{leaf}" if owner else leaf), full


def adapter_tensors(model: torch.nn.Module, adapter: str = ADAPTER) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective. `adapter`'s A and B of each targeted layer under the names PEFT saves them with
    (`base_model.model.<module>.lora_A.weight`), full tensors (gathered from the shards); nothing of the base
    or of another adapter."""
    parts = {f".lora_A.{adapter}.": ".lora_A.", f".lora_B.{adapter}.": ".lora_B."}
    for name, tensor in persistence.named_tensors(model.get_base_model()):
        for part, saved in parts.items():
            if part in name:
                yield f"base_model.model.{name.replace(part, saved)}", _full(tensor)


def adapter_config(model: torch.nn.Module, source_path: str, adapter: str = ADAPTER) -> dict:
    """The adapter's adapter_config.json content (rank, alpha, target modules, ...) as PEFT writes it: plain
    JSON values (sets as sorted lists), so it travels over HTTP and loads with `PeftModel.from_pretrained`."""
    config = model.peft_config[adapter].to_dict()
    config["base_model_name_or_path"] = str(source_path)
    plain = lambda value: sorted(value) if isinstance(value, (set, frozenset)) else str(value)  # noqa: E731
    return json.loads(json.dumps(config, default=plain))


def delta_weight(layer: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """B·A · scale of one LoRA layer ([out, in]), in float32 whatever the parameters' dtype."""
    a = full(layer.lora_A[ADAPTER].weight).float()  # [rank, in]
    b = full(layer.lora_B[ADAPTER].weight).float()  # [out, rank]
    return (b @ a) * layer.scaling[ADAPTER]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def export(directory: Path, model: torch.nn.Module, source_path: str, dtype: str, merge: bool,
           adapters: list[str] | None = None) -> None:
    """Collective. Rank 0 writes the PEFT adapter directory (`adapter_config.json`,
    `adapter_model.safetensors`, the source's tokenizer files), which `peft.PeftModel.from_pretrained` loads
    on the base; with `merge`, also the merged model as a full checkpoint in `directory/merged`. With
    `adapters` (multi-LoRA): one such directory per adapter, `directory/<name>`, and no merged model."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        for name in adapters or [ADAPTER]:
            target = directory / name if adapters else directory
            target.mkdir(parents=True, exist_ok=True)
            # No embedding layer is ever a target (linear layers only), so none is saved, and PEFT's check for
            # a resized vocabulary (which reads the base's config, from the Hub if not local) is not needed.
            weights = get_peft_model_state_dict(model, state_dict=state, adapter_name=name,
                                                save_embedding_layers=False)
            save_file({key: t.to(getattr(torch, dtype)).contiguous() for key, t in weights.items()},
                      str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
            config = model.peft_config[name]
            config.base_model_name_or_path = str(source_path)
            config.save_pretrained(str(target))
            persistence.copy_side_files(Path(source_path), target)
    if merge:
        merged = {name: tensor.cpu() for name, tensor in merged_tensors(model)}
        persistence.write_hf(directory / MERGED_LORA_DIR, model.get_base_model(), merged, source_path, dtype)
    else:
        dist.barrier()


def build_adapter_optimizer(
    model: torch.nn.Module, trainers: dict[str, TrainerConfig], total_steps: dict[str, int | None],
    adapter_step: dict[str, int],
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, dict[str, int]]:
    """Multi-LoRA: one AdamW over every adapter, param groups per adapter (in `trainers`' order; the index of
    each adapter's first is returned) with its
    own lr, weight decay and schedule, which follows that adapter's own step count (`adapter_step[name]`,
    advanced by the caller). Adam's state is per parameter and a parameter without a gradient is skipped, so
    a step that trains one adapter leaves the others' weights, moments and lr where they were."""
    groups, lambdas, first_group = [], [], {}
    for name, cfg in trainers.items():
        steps = total_steps.get(name)
        if cfg.lr_schedule != "constant" and (steps is None or steps < 1):
            raise ValueError(f"trainer.lr_schedule = {cfg.lr_schedule!r} needs adapter {name!r}'s total steps, "
                             f"got {steps}")
        params = adapter_parameters(model, name)
        first_group[name] = len(groups)
        for group in ({"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}):
            if group["params"]:  # no empty group: a checkpoint's optimizer state holds none
                groups.append({**group, "lr": cfg.lr})
                lambdas.append(lambda _epoch, name=name, cfg=cfg, steps=steps: lr_factor(adapter_step[name], cfg, steps))
    first = next(iter(trainers.values()))
    optimizer = torch.optim.AdamW(groups, lr=first.lr, betas=tuple(first.adam_betas), fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    return optimizer, scheduler, first_group
