"""An asyncio event loop on a virtual clock: when nothing is ready, time jumps to the next timer instead of
passing. Timing-dependent results (occupancy, rates) then depend on the code under test alone, not on how
busy the machine is. For code that only awaits timers and in-loop events (no threads, sockets or processes)."""

from __future__ import annotations

import asyncio
import selectors


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout=None):
        events = super().select(0)
        if not events and timeout is not None and timeout > 0:
            self._loop.now += timeout  # nothing to do until the next timer: it is due now
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self.now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


def run(coroutine):
    """`asyncio.run` on a virtual clock."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coroutine)
