"""The bound on every phase of an RL run: `await guard(phase, limit_field, awaitable)` waits at most
`fault.<limit_field>` seconds, past which the watchdog dumps every process's stacks and stops the run."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from verst.config import FaultConfig
from verst.orchestration.watchdog import Watchdog

T = TypeVar("T")


class Guard:
    """`Guard(fault, watchdog)`; without a watchdog (a run assembled from stand-ins) phases are unbounded."""

    def __init__(self, fault: FaultConfig, watchdog: Watchdog | None = None):
        self.fault, self.watchdog = fault, watchdog

    async def __call__(self, phase: str, limit_field: str, awaitable: Awaitable[T]) -> T:
        """`await awaitable` within `fault.<limit_field>`; past it `StuckError` names `phase` and the field."""
        if self.watchdog is None:
            return await awaitable
        limit = getattr(self.fault, limit_field)
        return await self.watchdog.guard(phase, limit, f"fault.{limit_field}", awaitable)
