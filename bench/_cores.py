"""The cores a bench gives every side it compares, by construction: the first N cores this process may run on,
each side's processes pinned to them (affinity is inherited: a side's Ray and its actors stay on them too)."""

from __future__ import annotations

import os

from verst.types.cores import core_ranges, usable_cores


def bench_cores(count: int | None) -> tuple[int, ...]:
    """The first `count` usable cores (all of them when None); more than there are is refused."""
    usable = usable_cores()
    if count is not None and not 1 <= count <= len(usable):
        raise SystemExit(f"--cores {count}: this process may run on {len(usable)} core(s) ({core_ranges(usable)})")
    return usable[:count] if count else usable


def pin_here(cores: tuple[int, ...]) -> None:
    """This process, and every process it starts from now on, runs on `cores` only."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))


def pinned_to(cores: tuple[int, ...]):
    """A subprocess `preexec_fn` that pins the child (and what it starts) to `cores`."""
    return lambda: pin_here(cores)


def describe(cores: tuple[int, ...]) -> str:
    return f"cores {core_ranges(cores)} ({len(cores)})"
