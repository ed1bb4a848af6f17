"""The simulated workload: a prompt data set of a given length and size (rows carry what the simulated agent
needs), a reward whose share of zero-variance groups is set, and an agent that runs a given number of turns
through the session server with environment time between them. Everything follows from the row and the
sample's index, so a run replays.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from verst.sim.config import SimConfig
from verst.types import Sample

SIM_KEY = "sim"  # a row's metadata: the agent's turns, environment time (wall seconds) and observation
_AGENT_TIMEOUT = aiohttp.ClientTimeout(total=3600.0, connect=30.0)


class AgentTally:
    """The simulated agents' trajectories finished in this process (the driver's, where a simulated run keeps its
    rollout manager): trajectories end after fewer turns than `sim.agent_turns` when a reply hits its length."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished = 0

    def add(self) -> None:
        with self._lock:
            self.finished += 1


AGENTS = AgentTally()


def write_data(sim: SimConfig, train: Path, test: Path) -> None:
    """`train` (`sim.prompts` rows) and `test` (64 rows), JSONL. A row's label is the chance that a sample of it
    is right: 0 or 1 for the zero-variance share of prompts, 0.5 for the others."""
    draw = random.Random(f"verst.sim.data/{sim.prompts}/{sim.prompt_tokens}")
    agent = {"turns": sim.agent_turns, "env_wall_s": sim.env_seconds / sim.speedup,
             "observation": "o" * sim.observation_tokens}
    for path, rows in ((train, sim.prompts), (test, 64)):
        lines = []
        for i in range(rows):
            p = draw.choice((0.0, 1.0)) if draw.random() < sim.zero_variance_fraction else 0.5
            words = "".join(draw.choice("abcdefghij ") for _ in range(sim.prompt_tokens - 12))
            lines.append(json.dumps({"prompt": f"task {i:06d}: {words}", "label": str(p),
                                     "metadata": {SIM_KEY: agent}}))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")


async def reward(sample: Sample) -> float:
    """1 with the row's chance (its label), drawn from the sample's index."""
    chance = float(sample.label)
    if chance in (0.0, 1.0):
        return chance
    return float(zlib.crc32(sample.index.to_bytes(8, "little")) % 1000 < chance * 1000)


async def agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """`turns` chat completions through the session, each followed by the environment's time and its
    observation (a tool's reply) as the next user message. One aiohttp session a trajectory: its turns share
    a connection, and the agent's own CPU stays small next to the control plane it exercises."""
    spec = metadata[SIM_KEY]
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    async with aiohttp.ClientSession(timeout=_AGENT_TIMEOUT) as client:
        for turn in range(spec["turns"]):
            body = orjson.dumps({"messages": messages, **request_kwargs})
            async with client.post(f"{base_url}/chat/completions", data=body,
                                   headers={"content-type": "application/json"}) as response:
                raw = await response.read()
            if response.status != 200:
                raise RuntimeError(f"turn {turn}: the session server answered {response.status}: {raw[:200]!r}")
            reply = orjson.loads(raw)["choices"][0]
            messages.append({"role": "assistant", "content": reply["message"]["content"] or ""})
            if reply.get("finish_reason") == "length" or turn == spec["turns"] - 1:
                break
            await asyncio.sleep(spec["env_wall_s"])
            messages.append({"role": "user", "content": spec["observation"]})
    AGENTS.add()
    return {"sim_turns": len(messages) // 2}

