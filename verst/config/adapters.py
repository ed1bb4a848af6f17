"""Multi-LoRA configs: each `[[lora.adapters]]` entry as the run config of that adapter alone (its data,
reward, batch plan, optimizer and served name on the run's settings), and the combinations refused at load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from verst.config.arithmetic import batch_plan

if TYPE_CHECKING:
    from verst.config.schema import LoraAdapterConfig, LoraConfig, VerstConfig

MULTI_LORA_SCHEDULES = ("sync", "fully_async")
MAX_ADAPTERS = 8  # the embedded engine's default --max-loaded-loras: every adapter stays resident


def adapter_names(cfg: VerstConfig) -> list[str]:
    return [adapter.name for adapter in cfg.lora.adapters]


def adapter_run_config(cfg: VerstConfig, name: str) -> VerstConfig:
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


def check_adapters(cfg: VerstConfig) -> None:
    """The multi-LoRA combinations a run can carry out; anything else is refused naming the field."""
    lora, names = cfg.lora, adapter_names(cfg)
    if not lora.enabled:
        raise ValueError(f"lora.adapters names {names} but lora.enabled = false; set lora.enabled = true")
    if lora.sync != "adapter":
        raise ValueError(f"lora.adapters (multi-LoRA) with lora.sync = {lora.sync!r}: the engines serve every "
                         "adapter by name on their base; use lora.sync = 'adapter'")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"lora.adapters: the names {duplicates} appear more than once; each adapter needs its own name")
    if len(names) > MAX_ADAPTERS:
        raise ValueError(f"lora.adapters holds {len(names)} adapters; the engines keep at most {MAX_ADAPTERS} "
                         "resident (--max-loaded-loras)")
    if cfg.schedule not in MULTI_LORA_SCHEDULES:
        raise ValueError(f"lora.adapters (multi-LoRA) with schedule = {cfg.schedule!r}: multi-LoRA runs on the "
                         f"schedules {MULTI_LORA_SCHEDULES}")
    if cfg.checkpoint.merge_lora:
        raise ValueError("checkpoint.merge_lora = true with lora.adapters: a merged model holds one adapter; "
                         "export the adapters (hf/<name>) and merge the one you need")
    if cfg.eval.backend is not None:
        raise ValueError(f"eval.backend = {cfg.eval.backend!r} with lora.adapters: evaluation snapshots hold one "
                         "policy; multi-LoRA runs evaluate each adapter on the rollout engines")
    if cfg.eval.num_engines:
        raise ValueError(f"eval.num_engines = {cfg.eval.num_engines} with lora.adapters: the evaluation fleet serves "
                         "one policy's snapshot; multi-LoRA runs evaluate each adapter on the rollout engines "
                         "(eval.num_engines = 0)")
    if cfg.algorithm.needs_critic:
        raise ValueError("algorithm.advantage_estimator = 'ppo' with lora.adapters: one critic would fit every "
                         "adapter's task at once; multi-LoRA runs take the critic-free estimators (grpo, rloo, ...)")
    if cfg.teacher.model_path is not None:
        raise ValueError(f"teacher.model_path = {cfg.teacher.model_path!r} with lora.adapters: on-policy "
                         "distillation trains one policy; remove teacher.model_path or lora.adapters")
    if cfg.sync.interval != 1:
        raise ValueError(f"sync.interval = {cfg.sync.interval} with lora.adapters: each adapter's step is pushed "
                         "under its own name right after it; use sync.interval = 1")
    for index, adapter in enumerate(lora.adapters):
        if isinstance(adapter.target_modules, list) and not [m for m in adapter.target_modules if m.strip()]:
            raise ValueError(f"lora.adapters[{index}].target_modules = {adapter.target_modules} names no module")
        try:
            own = adapter_run_config(cfg, adapter.name)
        except ValidationError as error:
            problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in error.errors())
            raise ValueError(f"lora.adapters[{index}] ({adapter.name!r}): {problems}") from None
        steps = batch_plan(own).train_steps_per_rollout
        if cfg.schedule == "sync" and steps != 1:
            raise ValueError(f"lora.adapters[{index}] ({adapter.name!r}): {steps} optimizer steps per rollout batch; "
                             "the sync schedule interleaves adapters one step per rollout batch: set its "
                             "global_batch_size to its batch_size x n_samples_per_prompt")


def _find(cfg: VerstConfig, name: str) -> LoraAdapterConfig:
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
