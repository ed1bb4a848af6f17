"""bench/scale.py client: the engine client's CPU per /generate through the real sglang-router in front of N
simulated engines (one fleet process), at a given concurrency with distinct routing keys. Each client variant
runs in this process alone; its CPU is this process's, the router's and the fleet's from /proc."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from verst.inference_client.client import EngineClient
from verst.router import RouterManager
from verst.sim.config import SimConfig
from verst.sim.fleet import FleetSpec
from verst.sim.fleet_group import SimFleetGroup
from verst.sim.measure import cpu_seconds

PROMPT = list(range(97, 97 + 64))  # 64 lowercase byte ids


def fleet(engines: int, reply_tokens: int, speedup: float) -> SimFleetGroup:
    sim = SimConfig(speedup=speedup, response_tokens_mean=reply_tokens, response_tokens_sigma=0.0)
    spec = FleetSpec(count=engines, costs=sim.engine_costs_inputs(), speedup=speedup, model_path="sim",
                     vocab_size=32000, response_tokens_mean=reply_tokens, response_tokens_sigma=0.0,
                     max_running=sim.max_running, restart_s=0.0)
    return SimFleetGroup(spec)


async def drive(send: Any, requests: int, concurrency: int) -> float:
    """`requests` calls of `send(i)`, `concurrency` at a time; the wall seconds."""
    next_i = iter(range(requests))

    async def worker() -> None:
        for i in next_i:
            await send(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


def engine_client_send(client: EngineClient, reply_tokens: int) -> Any:
    async def send(i: int) -> None:
        result = await client.generate(PROMPT, {"max_new_tokens": reply_tokens}, routing_key=f"k{i}")
        assert len(result.output_ids) == reply_tokens, result

    return send


BEFORE_REV = "874016a"  # the httpx client with sharded pools and stdlib JSON, the baseline of the wires


def client_of(variant: str, router_url: str, concurrency: int) -> Any:
    """`before`: the client as it was at `BEFORE_REV`, loaded from git; otherwise the client with that wire."""
    if variant != "before":
        return EngineClient(router_url, max_connections=concurrency, wire=variant)
    import subprocess
    import types

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "show", f"{BEFORE_REV}:verst/inference_client/client.py"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("verst_client_before")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, "client_before.py", "exec"), module.__dict__)
    return module.EngineClient(router_url, max_connections=concurrency)


async def measure(variant: str, router_url: str, requests: int, concurrency: int, reply_tokens: int,
                  pids: dict[str, list[int]]) -> dict[str, float]:
    client = client_of(variant, router_url, concurrency)
    send = engine_client_send(client, reply_tokens)
    await drive(send, min(requests // 10, 2000), concurrency)  # warm: connections open, pools filled
    before = {name: sum(cpu_seconds(p) for p in group) for name, group in pids.items()}
    mine = cpu_seconds(os.getpid())
    load = os.getloadavg()[0]
    wall = await drive(send, requests, concurrency)
    client_cpu = cpu_seconds(os.getpid()) - mine
    after = {name: sum(cpu_seconds(p) for p in group) for name, group in pids.items()}
    await client.close()
    out = {"requests_per_s": requests / wall, "client_ms": 1000 * client_cpu / requests, "load_average": load}
    out |= {f"{name}_ms": 1000 * (after[name] - before[name]) / requests for name in pids}
    return out


def run_client_probe(engines: int, requests: int, concurrency: int, reply_tokens: int, variants: list[str],
                     repeats: int) -> dict[str, Any]:
    """Every variant `repeats` times, interleaved, against one fleet and one router."""
    with fleet(engines, reply_tokens, speedup=1e6) as group:
        router = RouterManager(group.urls, policy="manual", assignment_mode="min_load", startup_timeout=120.0).start()
        try:
            pids = {"router": [router.proc.pid], "fleet": group.pids}
            results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
            for _ in range(repeats):
                for variant in variants:
                    results[variant].append(asyncio.run(measure(variant, router.url, requests, concurrency,
                                                                reply_tokens, pids)))
            return {"engines": engines, "requests": requests, "concurrency": concurrency,
                    "reply_tokens": reply_tokens, "results": results}
        finally:
            router.stop()
