"""bench/scale.py memory: the rollout manager's memory per trajectory in flight.

The real rollout manager (router, data source, rollout fn, fully async worker, engine client) runs in a thread of
this process, as in `verst sim`, against simulated engines slowed so far (speed-up 1e-6) that no trajectory
finishes while it is measured. Python's allocations are traced (tracemalloc) from just before the worker starts
until every trajectory it may hold (`rollout.max_in_flight`) has reached an engine: what is still allocated then,
over the trajectories, is the memory one trajectory in flight holds on the rollout side (the process's resident
memory is read beside it; it also counts what Python's allocators keep after frees). Measured at two prompt
lengths, the line through the two points splits it into a part per prompt token (the token ids, the prompt's text
and the request's body) and a part per trajectory beyond them (the intercept).
"""

from __future__ import annotations

import functools
import gc
import json
import resource
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench._scale_run import request_per_args, requests_at_once
from verst.models import load_tokenizer
from verst.rollout.from_config import build_rollout_parts
from verst.run.setup import router_spec
from verst.sim.command import load_sim
from verst.sim.fleet_group import SimFleetGroup
from verst.sim.local_manager import LocalRolloutManager
from verst.sim.setup import fleet_spec
from verst.sim.workload import write_data

HOLD_SPEEDUP = 1e-6  # simulated seconds per wall second: a decode step lasts hours, so nothing finishes


def measure_in_flight(model: Path, work: Path, engines: int, in_flight: int, prompt_chars: int, group_size: int,
                      request_per: str = "sample", timeout_s: float = 300.0) -> dict[str, Any]:
    """One measurement: `in_flight` trajectories held on `engines` simulated engines, prompts of `prompt_chars`
    characters. Returns the traced bytes per trajectory, the prompt's token count and the settle time."""
    cfg, sim = load_sim(None, [
        "--run-dir", str(work / f"memory-{engines}-{in_flight}-{prompt_chars}"), "--overwrite", "true",
        "--model.path", str(model), "--schedule", "fully_async", "--cluster.num-engines", str(engines),
        "--rollout.batch-size", str(max(1, in_flight // group_size)), "--rollout.n-samples-per-prompt", str(group_size),
        "--rollout.max-in-flight", str(in_flight),
        "--rollout.concurrency", str(requests_at_once(in_flight, group_size, request_per)), *request_per_args(request_per),
        "--rollout.max-response-tokens", "1024",
        "--rollout.max-prompt-tokens", str(2 * prompt_chars + 256), "--rollout.admission", "fill", "--logging.progress", "false",
        "--sim.speedup", str(HOLD_SPEEDUP), "--sim.prompt-tokens", str(prompt_chars),
        "--sim.prompts", str(max(4096, 2 * in_flight // group_size))])
    write_data(sim, Path(cfg.data.train_path), Path(cfg.data.test_path))
    with SimFleetGroup(fleet_spec(cfg, sim)) as fleet:
        manager = LocalRolloutManager(functools.partial(build_rollout_parts, cfg),
                                      router=router_spec(cfg, cfg.cluster.num_engines))
        try:
            manager.start(fleet.urls)
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            rss_before = _rss()
            manager.call("start_async")
            started = time.perf_counter()
            while (held := _held(fleet)) < in_flight:
                if time.perf_counter() - started > timeout_s:
                    raise RuntimeError(f"{held} of {in_flight} trajectories reached the engines in {timeout_s:.0f} s")
                time.sleep(0.2)
            settle_s = time.perf_counter() - started
            time.sleep(1.0)  # the last requests' replies to the client's writes
            gc.collect()
            traced = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            rss_growth = _rss() - rss_before
            prompt_ids = _prompt_ids(cfg)
        finally:
            manager.call("stop_async")
            manager.shutdown()
    return {"engines": engines, "in_flight": in_flight, "request_per": request_per, "prompt_chars": prompt_chars,
            "prompt_ids": prompt_ids,
            "traced_bytes": traced, "bytes_per_trajectory": traced / in_flight,
            "rss_bytes_per_trajectory": rss_growth / in_flight, "settle_s": settle_s}


def per_trajectory(points: list[dict[str, Any]]) -> dict[str, float]:
    """The line through (prompt ids, bytes per trajectory) of two measurements: bytes per prompt token and the
    bytes of a trajectory beyond its prompt (the intercept)."""
    short, long = sorted(points, key=lambda p: p["prompt_ids"])[:: len(points) - 1]
    slope = (long["bytes_per_trajectory"] - short["bytes_per_trajectory"]) / (long["prompt_ids"] - short["prompt_ids"])
    return {"bytes_per_prompt_id": slope,
            "bytes_beyond_prompt": short["bytes_per_trajectory"] - slope * short["prompt_ids"]}


def _held(fleet: SimFleetGroup) -> int:
    """Requests the engines hold (running or waiting)."""
    return sum(s.get("running", 0) + s.get("waiting", 0) for s in fleet.stats())


def _rss() -> int:
    """This process's resident bytes now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _prompt_ids(cfg: Any) -> int:
    """Token ids of one simulated prompt as the rollout side renders it (chat template, the model's tokenizer)."""
    row = json.loads(Path(cfg.data.train_path).read_text().splitlines()[0])
    prompt = row[cfg.data.prompt_key]
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return len(load_tokenizer(cfg.model.path).apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                                  return_dict=False))
