"""Faults on demand in a simulated run: once the trainer has taken `sim.fault_after_steps` steps, a chosen share
of the engines dies, stalls (stops answering, /health included), slows down or refuses weight loads. Which
engines is drawn from a fixed seed, so a run replays; what struck when is kept for the scale summary."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from verst.sim.config import SimConfig
from verst.sim.fleet_group import SimFleetGroup

log = logging.getLogger(__name__)
POLL_S = 0.05


def fault_plan(sim: SimConfig, engines: int) -> dict[str, list[int]]:
    """Engine indices per fault kind, disjoint, drawn from a fixed seed (each share rounded to whole engines)."""
    order = random.Random(f"verst.sim.faults/{engines}").sample(range(engines), engines)
    plan, at = {}, 0
    for kind, share in (("die", sim.kill_fraction), ("stall", sim.stall_fraction), ("slow", sim.slow_fraction),
                        ("refuse_loads", sim.refuse_load_fraction)):
        count = round(share * engines)
        plan[kind], at = sorted(order[at:at + count]), at + count
    if at > engines:
        raise ValueError(f"sim fault shares add up to {at} of {engines} engines")
    return plan


class FaultInjector:
    """`async with FaultInjector(sim, fleet, version):` strikes once `version()` reaches the threshold."""

    def __init__(self, sim: SimConfig, fleet: SimFleetGroup, version: Callable[[], int]):
        self.sim, self.fleet, self.version = sim, fleet, version
        self.plan = fault_plan(sim, len(fleet.urls))
        self.events: list[dict[str, Any]] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> FaultInjector:
        if any(self.plan.values()):
            self._task = asyncio.create_task(self._strike(), name="verst-sim-faults")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _strike(self) -> None:
        while self.version() < self.sim.fault_after_steps:
            await asyncio.sleep(POLL_S)
        for kind, indices in self.plan.items():
            for index in indices:
                await asyncio.to_thread(self.fleet.fault, index, kind, self.sim.slow_factor)
                self.events.append({"kind": kind, "engine": index, "at_step": self.version(), "wall": time.time()})
        log.warning("simulated faults at step %d: %s", self.version(),
                    ", ".join(f"{kind} {indices}" for kind, indices in self.plan.items() if indices))

    def summary(self) -> dict[str, Any]:
        return {kind: len(indices) for kind, indices in self.plan.items()} | {"events": len(self.events)}
