"""Multi-LoRA configs: each `[[lora.adapters]]` entry as the run config of that adapter alone (its data,
reward, batch plan, optimizer and served name on the run's settings); `rules` says which combinations run.
"""

from __future__ import annotations

from typing import Any, TypeVar

from verst.config.section import Section
from verst.config.training import LoraAdapterConfig, LoraConfig

C = TypeVar("C", bound=Section)  # a VerstConfig


def adapter_names(cfg: Any) -> list[str]:
    return [adapter.name for adapter in cfg.lora.adapters]


def adapter_run_config(cfg: C, name: str) -> C:
    """The run config one adapter of a multi-LoRA run trains under: `lora` as a single adapter served under
    `name` (its rank, alpha, dropout, targets), its data, reward, eval prompts, rollout and optimizer sizes,
    and every other section the run's. Validated as a config of its own (batch arithmetic included)."""
    adapter = _find(cfg, name)
    lora = cfg.lora.model_dump()
    lora.update(name=name, adapters=[], **{key: value for key in ("rank", "alpha", "dropout", "target_modules")
                                           if (value := getattr(adapter, key)) is not None})
    rollout = cfg.rollout.model_dump()
    rollout.update({key: value for key in ("batch_size", "n_samples_per_prompt", "num_rollouts")
                    if (value := getattr(adapter, key)) is not None})
    trainer = cfg.trainer.model_dump()
    trainer.update({key: value for key in ("global_batch_size", "lr") if (value := getattr(adapter, key)) is not None})
    resized = adapter.batch_size is not None or adapter.n_samples_per_prompt is not None
    if resized and adapter.global_batch_size is None:
        trainer["global_batch_size"] = None  # one optimizer step per rollout batch of the adapter's own size
    eval_cfg = cfg.eval.model_dump()
    if adapter.eval_path is not None or adapter.data is not None:
        eval_cfg["path"] = adapter.eval_path
    data = (adapter.data or cfg.data).model_dump()
    reward = (adapter.reward or cfg.reward).model_dump()
    run = cfg.model_dump()
    run.update(lora=lora, rollout=rollout, trainer=trainer, eval=eval_cfg, data=data, reward=reward)
    return type(cfg).model_validate(run)


def _find(cfg: Any, name: str) -> LoraAdapterConfig:
    for adapter in cfg.lora.adapters:
        if adapter.name == name:
            return adapter
    raise KeyError(f"lora.adapters has no adapter {name!r}; its adapters: {adapter_names(cfg)}")


def adapter_lora_configs(lora: LoraConfig) -> dict[str, LoraConfig]:
    """Each adapter of `lora.adapters` as a single-adapter `LoraConfig` (its overrides on `lora`'s settings),
    by name, in order; empty without adapters."""
    out = {}
    for adapter in lora.adapters:
        overrides = {key: value for key in ("rank", "alpha", "dropout", "target_modules")
                     if (value := getattr(adapter, key)) is not None}
        out[adapter.name] = lora.model_copy(update={"name": adapter.name, "adapters": [], **overrides})
    return out
