"""Layer 4.1: the readable loops — sync, one-step-off and fully async RL, and SFT.

`SCHEDULES` maps `schedule` to its loop, restarted after a trainer rank's death as `fault.max_restarts`
allows (`restarts`); each imports its heavy parts only when run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


def _lazy(module: str, name: str) -> Callable[..., Awaitable[Any]]:
    def run(cfg):
        import importlib

        from verst.run.restarts import run_restarting

        return run_restarting(getattr(importlib.import_module(module), name), cfg)

    return run


SCHEDULES: dict[str, Callable[..., Awaitable[Any]]] = {
    "sync": _lazy("verst.schedules.sync", "run_sync"),
    "one_step_off": _lazy("verst.schedules.one_step_off", "run_one_step_off"),
    "fully_async": _lazy("verst.schedules.fully_async", "run_fully_async"),
}
