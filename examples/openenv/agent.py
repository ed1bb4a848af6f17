"""The OpenEnv example's agent fn: `examples.openenv.agent:run` plays the stand-in arithmetic environment
(examples/openenv/env.py, served in this process on first use) with `verst.connectors.openenv`.

The task's metadata holds `openenv_reset` ({"seed": n}: which problem); the reward is the environment's
(`verst.connectors.openenv:env_reward`).
"""

from __future__ import annotations

import threading
from typing import Any

from examples.openenv.env import MAX_ATTEMPTS, AnswerAction, ArithmeticEnvClient, serve
from verst.connectors.openenv import OpenEnvAgent

_lock = threading.Lock()
_url: str | None = None


def env_url() -> str:
    """The stand-in environment's URL, served once per process (the rollout manager's)."""
    global _url
    with _lock:
        if _url is None:
            _url, _ = serve()
        return _url


def connect(metadata: dict[str, Any]) -> ArithmeticEnvClient:
    return ArithmeticEnvClient(base_url=metadata.get("openenv_url") or env_url())


def observe(observation: Any) -> str:
    return f"{observation.problem} {observation.feedback}"


run = OpenEnvAgent(connect, lambda text: AnswerAction(answer=text), observe=observe, max_steps=MAX_ATTEMPTS)
