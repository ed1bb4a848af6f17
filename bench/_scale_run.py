"""bench/scale.py run and sync: a `verst sim` run at N engines with K trajectories in flight per engine (its
scale.json is the measurement), and a weight push fanned out to N simulated engines by the real syncer."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from verst.inference_client.client import Timeouts
from verst.inference_client.fleet import EngineFleet
from verst.sim.command import load_sim, run_sim
from verst.sim.config import SimConfig
from verst.sim.fleet import FleetSpec
from verst.sim.fleet_group import SimFleetGroup
from verst.sim.measure import cpu_seconds
from verst.sim.trainer import SimBackend
from verst.sim.transport import SimTransport
from verst.sync.syncer import WeightSyncer


def model_dir(work: Path) -> Path:
    """A tiny model's directory: the simulated rollout side tokenizes with its tokenizer."""
    from verst.models import init_model

    path = work / "tiny-qwen3"
    if not (path / "config.json").exists():
        init_model("qwen3", "tiny", path, seed=0)
    return path


def run_args(args: Any, work: Path, repeat: int) -> list[str]:
    in_flight = args.engines * args.in_flight
    groups = max(4, in_flight // (args.group_size * args.steps_per_flight))
    out = [
        "--run-dir", str(work / f"run-{args.engines}-{args.in_flight}-{args.turns}-{repeat}"), "--overwrite", "true",
        "--model.path", str(model_dir(work)), "--schedule", args.schedule, "--cluster.num-engines", str(args.engines),
        "--rollout.batch-size", str(groups), "--rollout.n-samples-per-prompt", str(args.group_size),
        "--rollout.num-rollouts", str(args.steps), "--rollout.max-in-flight", str(in_flight),
        "--rollout.concurrency", str(requests_at_once(in_flight, args.group_size, args.request_per)),
        "--rollout.max-response-tokens", str(args.max_tokens), *request_per_args(args.request_per),
        "--rollout.dynamic-filter", "zero_std", "--buffer.max-staleness", str(args.max_staleness),
        "--buffer.capacity-factor", "4", "--eval.interval", "0", "--eval.max-prompts", "16",
        "--logging.progress", "false", "--logging.tensorboard", "false", "--logging.sample-groups-per-step", "0",
        "--checkpoint.save", "false", "--checkpoint.export-hf", "false", "--fault.engine-call-timeout-s", "300",
        "--sim.speedup", str(args.speedup), "--sim.response-tokens-mean", str(args.reply_tokens),
        "--sim.prompts", str(max(4096, 4 * in_flight // args.group_size)), "--sim.warmup-steps", str(args.warmup),
        "--sim.fleet-processes", str(args.fleet_processes), "--sim.trainer-gpus", str(args.trainer_gpus),
        "--sim.kill-fraction", str(args.kill), "--sim.stall-fraction", str(args.stall),
        "--sim.fault-after-steps", str(args.warmup + 1), "--fault.health-interval-s", "2",
        "--sync.bucket-bytes", str(args.bucket_bytes),
    ]
    if args.turns:
        out += ["--sim.agent-turns", str(args.turns), "--sim.env-seconds", str(args.env_seconds),
                "--rollout.max-context-tokens", str(args.turns * (args.max_tokens + 200) + 512)]
    return out


def request_per_args(request_per: str) -> list[str]:
    """`rollout.request_per`; one request per group also frees a fully async worker's places by the group."""
    return ["--rollout.request-per", request_per, "--rollout.submission-granularity", request_per]


def requests_at_once(in_flight: int, group_size: int, request_per: str) -> int:
    """`rollout.concurrency` for `in_flight` trajectories: a request each, or one per group of `group_size`."""
    return in_flight if request_per == "sample" else -(-in_flight // group_size)


class GcClock:
    """Collections of this process (the driver's, which holds the rollout manager in a simulated run) and the seconds
    they took, by generation, while installed (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.by_generation: dict[int, list[float]] = {}
        self._started = 0.0

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.by_generation.setdefault(info["generation"], []).append(time.perf_counter() - self._started)

    def summary(self) -> dict[str, dict[str, float]]:
        return {f"gen{g}": {"collections": len(times), "seconds": sum(times)}
                for g, times in sorted(self.by_generation.items())}


def run_once(args: Any, repeat: int) -> dict[str, Any]:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="verst-scale-"))
    cfg, sim = load_sim(None, run_args(args, work, repeat))
    started, load = time.perf_counter(), os.getloadavg()[0]
    with GcClock() as collections:
        summary, scale = run_sim(cfg, sim)
    scale["gc"] = collections.summary()
    scale["wall_s"], scale["load_average_before"] = time.perf_counter() - started, load
    scale["stale_share"] = scale["accounting"]["discarded"].get("stale", 0) / max(scale["accounting"]["served"], 1)
    return scale


# ---- the weight push fanned out ------------------------------------------------------------------------------
async def _pushes(urls: list[str], total_params: float, bucket_bytes: int, pushes: int, sim: SimConfig,
                  fleet_pids: list[int], first_version: int = 1) -> list[dict[str, float]]:
    out = []
    async with EngineFleet(urls, timeouts=Timeouts(control=300.0, weights=600.0)) as fleet:
        syncer = WeightSyncer(fleet, SimTransport(fleet, bucket_bytes))
        backend = SimBackend(total_params, sim.bytes_per_param)
        for version in range(first_version, first_version + pushes):
            mine, theirs, load = cpu_seconds(os.getpid()), sum(cpu_seconds(p) for p in fleet_pids), os.getloadavg()[0]
            metrics = await syncer.sync(backend.named_weights(bucket_bytes), version)
            modelled = metrics["sync/bytes"] / sim.load_bytes_per_s / sim.speedup
            out.append({"seconds": metrics["sync/seconds"], "modelled_s": modelled,
                        "overhead_s": metrics["sync/seconds"] - modelled, "buckets": metrics["sync/buckets"],
                        "syncer_cpu_s": cpu_seconds(os.getpid()) - mine,
                        "fleet_cpu_s": sum(cpu_seconds(p) for p in fleet_pids) - theirs, "load_average": load})
    return out


def run_sync_fanout(engines: int, total_params: float, bucket_bytes: int, pushes: int, speedup: float,
                    processes: int) -> dict[str, Any]:
    sim = SimConfig(speedup=speedup, total_params=total_params, active_params=total_params)
    spec = FleetSpec(count=engines, costs=sim.engine_costs_inputs(), speedup=speedup, model_path="sim",
                     vocab_size=32000, response_tokens_mean=16, response_tokens_sigma=0.0, max_running=256,
                     restart_s=0.0)
    with SimFleetGroup(spec, processes=processes) as group:
        rows = asyncio.run(_pushes(group.urls, total_params, bucket_bytes, pushes, sim, group.pids))
    return {"engines": engines, "total_params": total_params, "bucket_bytes": bucket_bytes, "speedup": speedup,
            "pushes": rows}


def dump(path: str | None, value: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(value, indent=1))
