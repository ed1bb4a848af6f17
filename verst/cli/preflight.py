"""Checks of a config's files before anything starts (Ray, engines, trainer ranks): every path it
reads, the model's tokenizer, the plug-in modules it names and the run directory, each problem naming
its field and path. Fast (no torch, no transformers), so `--dry-run` runs them too.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from verst.config import VerstConfig
from verst.config.registries import GROUP_FILTERS
from verst.config.rules import check_sft_rules
from verst.engine_kinds.kinds import preflight_problems
from verst.models.loader import check_checkpoint_dir, check_same_tokenizer
from verst.models.native_config import native_config_reason
from verst.monitor import RunDirError, check_run_dir
from verst.monitor.checkpoint_dirs import CheckpointError, check_resume_config, resolve


class PreflightError(ValueError):
    """The config names files or modules that are not there; the message lists each, by field."""


def preflight(cfg: VerstConfig, *, rl: bool) -> None:
    """Raise `PreflightError` listing every problem found; `rl` adds the checks only RL runs need."""
    problems: list[str] = []
    try:
        check_checkpoint_dir(cfg.model.path, "model.path")
    except (OSError, ValueError) as error:
        problems.append(str(error))
    problems += _expert_parallel_problems(cfg)
    problems += _context_parallel_problems(cfg)
    if rl and cfg.teacher.model_path is not None:
        try:
            check_checkpoint_dir(cfg.teacher.model_path, "teacher.model_path")
            check_same_tokenizer(cfg.model.path, cfg.teacher.model_path)
        except (OSError, ValueError) as error:
            problems.append(str(error))
    if cfg.critic.model_path is not None:
        try:
            check_checkpoint_dir(cfg.critic.model_path, "critic.model_path")
        except (OSError, ValueError) as error:
            problems.append(str(error))
    if cfg.data.source is None:
        problems += _missing_file("data.train_path", cfg.data.train_path)
    eval_path = ("eval.path", cfg.eval.path) if cfg.eval.path else ("data.test_path", cfg.data.test_path)
    problems += _missing_file(*eval_path)
    if not rl:
        try:
            check_sft_rules(cfg)
        except ValueError as error:
            problems.append(str(error))
    for index, adapter in enumerate(cfg.lora.adapters if rl else []):  # each adapter's own prompts
        if adapter.data is not None and adapter.data.source is None:
            problems += _missing_file(f"lora.adapters[{index}].data.train_path", adapter.data.train_path)
        own_eval = adapter.eval_path or (adapter.data.test_path if adapter.data is not None else None)
        if own_eval is not None:
            field = "eval_path" if adapter.eval_path else "data.test_path"
            problems += _missing_file(f"lora.adapters[{index}].{field}", own_eval)
    if cfg.checkpoint.load is not None:
        try:
            check_resume_config(resolve(cfg.checkpoint.load), cfg)
        except (CheckpointError, OSError, KeyError) as error:
            problems.append(str(error))
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        problems.append("logging.wandb = true, but the wandb package is not installed (pip install wandb)")
    imports = {"data.source": cfg.data.source, "buffer.path": cfg.buffer.path}
    if rl:
        imports |= {"eval.backend": cfg.eval.backend, "rollout.rollout_fn": cfg.rollout.rollout_fn, "rollout.generate_fn": cfg.rollout.generate_fn,
                    "rollout.agent_fn": cfg.rollout.agent_fn}
        problems += preflight_problems(cfg.cluster.engine, cfg.cluster.engine_python)
        if cfg.rollout.dynamic_filter not in GROUP_FILTERS:
            imports["rollout.dynamic_filter"] = cfg.rollout.dynamic_filter
        if cfg.reward.type == "custom":
            imports["reward.path"] = cfg.reward.path
        algo = cfg.algorithm
        problems += _model_mode_problems(cfg)
        imports |= {"algorithm.mismatch_fn": algo.mismatch_fn, "algorithm.policy_loss_fn": algo.policy_loss_fn,
                    "algorithm.loss_reducer": algo.loss_reducer}
    for field, path in imports.items():
        if path:
            problems += _missing_module(field, path)
    try:
        check_run_dir(cfg)
    except RunDirError as error:
        problems.append(str(error))
    if problems:
        raise PreflightError("the config names things that are not there:\n  " + "\n  ".join(problems))


def _model_mode_problems(cfg: VerstConfig) -> list[str]:
    """`algorithm.routing_replay` needs an MoE checkpoint; `algorithm.true_on_policy` one the native model
    class covers (the engine's scoring pass is the trainer's native forward)."""
    algo, config_file = cfg.algorithm, Path(cfg.model.path) / "config.json"
    if (algo.routing_replay == "off" and not algo.true_on_policy) or not config_file.is_file():
        return []  # a missing checkpoint is reported by check_checkpoint_dir
    config = json.loads(config_file.read_text())
    problems = []
    if algo.routing_replay != "off" and not config.get("num_experts_per_tok"):
        problems.append(f"algorithm.routing_replay = {algo.routing_replay!r} needs an MoE model; model.path = "
                        f"{cfg.model.path!r} (model_type {config.get('model_type')!r}) has no expert router")
    reason = native_config_reason(config) if algo.true_on_policy else None
    if reason is not None:
        problems.append(f"algorithm.true_on_policy = true needs a model the native class covers; model.path = "
                        f"{cfg.model.path!r}: {reason}")
    return problems


def _expert_parallel_problems(cfg: VerstConfig) -> list[str]:
    """`trainer.expert_parallel_size` splits the checkpoint's experts: it needs some, in a number it divides (the
    model class is checked when the trainer builds it)."""
    ep, config_file = cfg.trainer.expert_parallel_size, Path(cfg.model.path) / "config.json"
    if ep == 1 or not config_file.is_file():
        return []  # a missing checkpoint is reported by check_checkpoint_dir
    config = json.loads(config_file.read_text())
    experts = config.get("num_local_experts") or config.get("num_experts")  # transformers 5 writes the first
    if not experts:
        return [f"trainer.expert_parallel_size = {ep} needs an MoE model; model.path = {cfg.model.path!r} "
                f"(model_type {config.get('model_type')!r}) has no experts"]
    if experts % ep:
        return [f"trainer.expert_parallel_size = {ep} does not divide the num_experts = {experts} of model.path = "
                f"{cfg.model.path!r}"]
    return []


def _context_parallel_problems(cfg: VerstConfig) -> list[str]:
    """`trainer.context_parallel_size` splits rows in verst's native attention: the checkpoint must be one the
    native model class covers."""
    cp, config_file = cfg.trainer.context_parallel_size, Path(cfg.model.path) / "config.json"
    if cp == 1 or not config_file.is_file():
        return []  # a missing checkpoint is reported by check_checkpoint_dir
    reason = native_config_reason(json.loads(config_file.read_text()))
    if reason is not None:
        return [f"trainer.context_parallel_size = {cp} needs a model the native class covers; model.path = "
                f"{cfg.model.path!r}: {reason}"]
    return []


def _missing_file(field: str, path: str | None) -> list[str]:
    if path is None or Path(path).is_file():
        return []
    what = "is a directory, not a file" if Path(path).is_dir() else "does not exist"
    return [f"{field} = {path!r} {what}"]


def _missing_module(field: str, path: str) -> list[str]:
    """The module part of an import path must be found (its parents are imported, the module is not)."""
    module = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
    if not module:
        return [f"{field} = {path!r} is not of the form 'package.module:name'"]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as error:
        return [f"{field} = {path!r}: cannot import a parent of module {module!r} ({error})"]
    return [] if found else [f"{field} = {path!r}: no module named {module!r} (on sys.path or in the working directory)"]
