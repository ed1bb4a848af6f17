"""A process's share of the CPU: the cores it runs on and its torch intra-op threads, and how a process takes it.

The run's core budget (`verst.run.cores`) hands one share to each trainer rank and each embedded engine; they
take it with `take_share` (every thread of the process pinned to the share's cores, then torch's threads set).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CoreShare:
    """`cores`: the CPU ids the process runs on; `threads`: its torch intra-op threads (at least one)."""

    cores: tuple[int, ...]
    threads: int

    def __post_init__(self) -> None:
        if not self.cores:
            raise ValueError("a core share needs at least one core")
        if self.threads < 1:
            raise ValueError(f"a core share needs at least one thread, got threads={self.threads}")

    def to_json(self) -> dict[str, object]:
        return {"cores": list(self.cores), "threads": self.threads}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> CoreShare:
        return cls(tuple(int(c) for c in data["cores"]), int(data["threads"]))

    def describe(self) -> str:
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} on cores {core_ranges(self.cores)}"


def usable_cores() -> tuple[int, ...]:
    """The CPU ids this process may run on (its affinity; every core where the platform has no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def core_ranges(cores: tuple[int, ...]) -> str:
    """`(0, 1, 2, 5)` -> `"0-2,5"`."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def pin_process(cores: tuple[int, ...]) -> bool:
    """Every thread of this process (threads started later inherit it) runs on `cores` only. False where
    the platform has no CPU affinity (macOS): the process then runs where the OS puts it."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    allowed = set(cores)
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, allowed)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return True


def take_share(share: CoreShare) -> None:
    """This process runs on `share.cores` with `share.threads` torch intra-op threads. Call it on the thread
    that runs the process's torch work: torch's thread count belongs to the calling thread's OpenMP state."""
    import torch

    if not pin_process(share.cores):
        log.info("CPU affinity is not available on this platform: %d torch threads, unpinned", share.threads)
    torch.set_num_threads(share.threads)


@contextlib.contextmanager
def share_taken(share: CoreShare) -> Iterator[None]:
    """`take_share(share)` for the block; the process's cores and torch threads as they were afterwards."""
    import torch

    threads, cores = torch.get_num_threads(), usable_cores()
    take_share(share)
    try:
        yield
    finally:
        pin_process(cores)
        torch.set_num_threads(threads)


def _thread_ids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no procfs: this thread only
        return [0]
