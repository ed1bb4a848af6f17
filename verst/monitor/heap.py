"""The cyclic garbage collector in a verst process of its own: the heap its start-up built is frozen, and young
objects are collected less often.

A collection walks every object of the generations it collects, and everything each holds: a rollout manager's
full passes walked its imported modules, its tokenizer and data, and the token lists of every trajectory in
flight, hundreds of milliseconds each (docs/benchmarks.md, "Garbage collection"). Once a process has started,
`settle_heap` collects once, moves every object then alive out of the collector's reach (`gc.freeze`: the
start-up state is never garbage) and raises the young generation's threshold, so that the trajectories in flight
are walked by fewer passes. Reference counting still frees every acyclic object at once; the collector finds
only the cycles, later.

Only in a process verst owns: the `verst` command (`own_heap` at its entry), the rollout manager's, trainer ranks'
and engine servers' processes. In a test runner, a notebook or an application that embeds verst, objects frozen
there that become cyclic garbage later would never be reclaimed, so `settle_heap` leaves such a process alone.
"""

from __future__ import annotations

import gc

# Allocations between young collections (CPython's default 700), and CPython's ratios above it.
THRESHOLDS = (50_000, 10, 10)
_owned = False


def own_heap() -> None:
    """This process is verst's own (a `verst` command): `settle_heap` acts in it."""
    global _owned
    _owned = True


def settle_heap(*, owned: bool = False) -> int:
    """At the end of a process's start-up: collect, freeze what is alive, raise the thresholds (see the module's
    docstring); `owned` marks the process as verst's own first. Returns the objects frozen in all (0: a process
    verst does not own, left alone)."""
    if owned:
        own_heap()
    if not _owned:
        return 0
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    return gc.get_freeze_count()
