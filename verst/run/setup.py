"""What an RL run's parts are started with, derived from its config: the engines' command lines, absolute
paths for actors started elsewhere, the routers, the first sync's weight check; and the start-up clock.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.config.registries import ENGINE_KINDS
from verst.config.rules import true_on_policy_on_the_cpu
from verst.engine_kinds.kinds import engine_kind
from verst.monitor.run_dir import run_dir_of
from verst.rollout.manager import RouterSpec
from verst.rollout.plugins import routed_experts_top_k


def engine_args(cfg: VerstConfig, device: str | None) -> list[str]:
    """The policy engines' command line for a run: `cluster.engine`'s server arguments (`engine_server_args`)
    and the modes of `algorithm` the engines carry out (true on-policy scoring, routed experts on every reply)."""
    args = engine_server_args(cfg)
    true_on_policy_on_the_cpu(cfg.algorithm, device)
    if cfg.algorithm.true_on_policy:
        args.append("--true-on-policy")
    if cfg.algorithm.routing_replay != "off":
        args.append("--return-routed-experts")
    return args


def engine_server_args(cfg: VerstConfig, version: int = 0) -> list[str]:
    """The engine server's arguments for `cluster.engine`: verst's settings and the pass-through flags."""
    kind, table = engine_kind(cfg.cluster.engine), ENGINE_KINDS.entry(cfg.cluster.engine).flags_table
    flags = getattr(cfg, table) if table else {}
    return kind.server_args(version=version, model_impl=cfg.model.impl, dtype=cfg.model.dtype, flags=flags,
                            engine_python=kind.python(cfg.cluster.engine_python), sampler=cfg.diffusion)


def absolute_paths(cfg: VerstConfig) -> VerstConfig:
    """The config with every file path made absolute: Ray actors do not share the driver's directory."""

    def absolute(path: str | None) -> str | None:
        return str(Path(path).resolve()) if path else path

    run_dir = absolute(cfg.run_dir or str(Path("runs") / cfg.name))
    return cfg.model_copy(update={
        "run_dir": run_dir,
        "model": cfg.model.model_copy(update={"path": absolute(cfg.model.path)}),
        "teacher": cfg.teacher.model_copy(update={"model_path": absolute(cfg.teacher.model_path)}),
        "critic": cfg.critic.model_copy(update={"model_path": absolute(cfg.critic.model_path)}),
        "data": cfg.data.model_copy(update={"train_path": absolute(cfg.data.train_path),
                                            "test_path": absolute(cfg.data.test_path)}),
        "eval": cfg.eval.model_copy(update={"path": absolute(cfg.eval.path)}),
        "reward": cfg.reward.model_copy(update={"model_path": absolute(cfg.reward.model_path)}),
        "rollout": cfg.rollout.model_copy(update={"dump_dir": absolute(cfg.rollout.dump_dir)}),
    })


def weight_checker(cfg: VerstConfig, trainer: Any, temperature: float) -> Any:
    """`sync.check_weights`: the check of the first sync against the trainer's logprobs (imports torch)."""
    if not cfg.sync.check_weights:
        return None
    from verst.sync.check import LogprobChecker

    return LogprobChecker(trainer.logprobs, temperature=temperature, lora_path=cfg.lora.served_adapter,
                          routed_experts_top_k=routed_experts_top_k(cfg))


def router_spec(cfg: VerstConfig, num_engines: int) -> RouterSpec | None:
    """The router in front of the engines: manual + min_load affinity for agent sessions, round robin for
    single-turn work; none for a single engine unless `cluster.router = 'always'`."""
    if cfg.cluster.router == "auto" and num_engines == 1:
        return None
    if cfg.rollout.agent_fn is not None:
        return RouterSpec(max_requests=cfg.rollout.concurrency)
    return RouterSpec(policy="round_robin", assignment_mode="min_load", max_requests=cfg.rollout.concurrency)


def logged_router_spec(own: VerstConfig, cfg: VerstConfig, adapter: str | None = None) -> RouterSpec | None:
    """The router of a lane (`own`'s; multi-LoRA: `adapter`'s), writing its output to
    RUN/logs/router[-<adapter>].log."""
    spec = router_spec(own, cfg.cluster.num_engines)
    if spec is None:
        return None
    name = f"router-{adapter}.log" if adapter else "router.log"
    return dataclasses.replace(spec, log_path=str(run_dir_of(cfg) / "logs" / name))


def eval_router(cfg: VerstConfig) -> tuple[str, str] | None:
    """The evaluation fleet's router (policy, assignment mode), chosen as the rollout engines' is."""
    spec = router_spec(cfg, cfg.eval.num_engines)
    return None if spec is None else (spec.policy, spec.assignment_mode)


class StartupClock:
    """Seconds spent in each start-up phase of a run, since `started` (perf_counter), as `time/startup/`
    metrics: the first thing to look at when a short run is slow."""

    def __init__(self, started: float):
        self.started = self._last = started
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now

    def metrics(self) -> dict[str, float]:
        out = {f"time/startup/{phase}_s": seconds for phase, seconds in self.phases.items()}
        out["time/startup_s"] = self._last - self.started
        return out

    def summary(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in self.phases.items())
        return f"{self._last - self.started:.1f} s ({parts})"
