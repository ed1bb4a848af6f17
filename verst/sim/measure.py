"""What a simulated run's control plane costs: CPU seconds of each process and thread that carries it (read from
/proc, so other processes' load does not count), resident memory, and the engines' busy time in the latency
model's clock, taken at two points and subtracted."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of process `pid` (or of its thread `tid`); 0 for one that is gone."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    try:
        fields = open(path).read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of stat)


def rss_bytes(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/statm").read().split()[1]) * PAGE
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0


@dataclasses.dataclass
class CpuMark:
    wall: float
    load: float  # the machine's 1-minute load average
    parts: dict[str, float]


class CpuMeter:
    """CPU seconds by part: `threads` (name -> native thread id in this process), `processes` (name -> pids);
    `driver` is this process minus its named threads."""

    def __init__(self, threads: dict[str, int], processes: dict[str, Sequence[int]]):
        self.threads, self.processes = threads, processes

    def mark(self) -> CpuMark:
        me = os.getpid()
        parts = {name: cpu_seconds(me, tid) for name, tid in self.threads.items()}
        parts["driver"] = cpu_seconds(me) - sum(parts.values())
        for name, pids in self.processes.items():
            parts[name] = sum(cpu_seconds(pid) for pid in pids)
        return CpuMark(time.perf_counter(), os.getloadavg()[0], parts)

    @staticmethod
    def between(start: CpuMark, end: CpuMark) -> dict[str, float]:
        """CPU seconds of each part from `start` to `end`, and the wall seconds between them."""
        out = {name: end.parts[name] - start.parts.get(name, 0.0) for name in end.parts}
        out["wall"] = end.wall - start.wall
        return out


def engine_window(start: list[dict[str, Any]], end: list[dict[str, Any]]) -> dict[str, float]:
    """The engines' time between two reads of their counters, in simulated seconds, over the engines that ran
    through both (a restarted engine's counters start again): the busy share of the time they could be busy
    (up and not paused for a weight push), the paused share, the mean batch while busy, requests finished."""
    before = {s["index"]: s for s in start if "busy_seconds" in s}
    busy = up = paused = batch = finished = 0.0
    for s in end:
        b = before.get(s["index"])
        if b is None or "busy_seconds" not in s or s["uptime_seconds"] < b["uptime_seconds"]:
            continue
        busy += s["busy_seconds"] - b["busy_seconds"]
        up += s["uptime_seconds"] - b["uptime_seconds"]
        paused += s["paused_seconds"] - b["paused_seconds"]
        batch += s["batch_seconds"] - b["batch_seconds"]
        finished += s["finished"] - b["finished"]
    available = up - paused
    return {"busy_fraction": busy / available if available > 0 else 0.0, "paused_fraction": paused / up if up else 0.0,
            "mean_batch": batch / busy if busy else 0.0, "requests": finished, "engine_seconds": up}
