"""The simulation's clock: simulated seconds run `speedup` times as fast as wall seconds (a speed-up below 1
slows the simulation down, so that a machine with few cores keeps pace with a large fleet)."""

from __future__ import annotations

import asyncio
import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class SimClock:
    """`speedup`: simulated seconds per wall second; `origin`: the wall (monotonic) time of simulated 0."""

    speedup: float = 1.0
    origin: float = dataclasses.field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"sim.speedup must be > 0, got {self.speedup}")

    def now(self) -> float:
        """Simulated seconds since the origin."""
        return (time.monotonic() - self.origin) * self.speedup

    def wall(self, sim_seconds: float) -> float:
        """The wall seconds `sim_seconds` of simulated time take."""
        return sim_seconds / self.speedup

    def sim(self, wall_seconds: float) -> float:
        return wall_seconds * self.speedup

    async def sleep(self, sim_seconds: float) -> None:
        await asyncio.sleep(self.wall(sim_seconds))
