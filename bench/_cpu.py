"""Where a bench's CPU goes: every process below this one (Ray's workers and engine servers included) and
this one, by role, sampled with the wall clock, so that the CPU seconds spent between two instants of a run
(its first and last timed steps) can be read afterwards, with how busy the cores were.

    with CpuMeter(cores) as cpu:
        ... run ...
    window = cpu.between(t0, t1)   # Unix times, e.g. two metrics records' "time"
    print(window.line(steps))
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time

import psutil
from _memory import role_of


@dataclasses.dataclass(frozen=True)
class CpuWindow:
    """CPU seconds by role between two instants, `seconds` of wall time apart, on `cores` cores."""

    seconds: float
    cores: int
    by_role: dict[str, float]

    @property
    def busy(self) -> float:
        """The share of the cores' time the processes kept busy."""
        return sum(self.by_role.values()) / (self.seconds * self.cores) if self.seconds > 0 else 0.0

    def line(self, steps: int) -> str:
        """'cores busy 96%; CPU ms a step: trainer rank 70, engine server 80, ...' over `steps` steps."""
        parts = ", ".join(f"{role} {1000 * s / steps:.0f}" for role, s in
                          sorted(self.by_role.items(), key=lambda kv: -kv[1]) if 1000 * s / steps >= 0.5)
        return f"cores busy {self.busy:.0%}; CPU ms a step: {parts}"

    def row(self, steps: int) -> dict[str, object]:
        return {"busy": self.busy, "cpu_ms_per_step": {role: 1000 * s / steps for role, s in self.by_role.items()}}


class CpuMeter:
    """Samples the CPU times (user + system) of this process and every descendant every `interval_s`; the
    processes are named by `role_of` their command line (this one as `label`). `cores`: how many cores the
    processes share."""

    def __init__(self, cores: int, interval_s: float = 0.2, label: str = "driver"):
        self.cores, self.interval_s, self.label = cores, interval_s, label
        self._samples: list[tuple[float, dict[int, tuple[str, float]]]] = []  # (Unix time, pid -> (role, cpu s))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def __enter__(self) -> CpuMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        me = psutil.Process()
        reading: dict[int, tuple[str, float]] = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                role = self.label if proc.pid == me.pid else role_of(" ".join(proc.cmdline()))
            except psutil.Error:
                continue
            reading[proc.pid] = (role, times.user + times.system)
        self._samples.append((time.time(), reading))

    def between(self, start: float, end: float) -> CpuWindow:
        """The CPU spent from the last sample at or before `start` to the first at or after `end` (a process
        that started in between counts from zero; one that ended counts up to its last sample), by each process's
        role at its latest sample (a Ray worker's command line names its actor once it hosts one)."""
        times = [t for t, _ in self._samples]
        if not times or end <= start:
            raise ValueError(f"CpuMeter: no samples for the window {start:.2f} .. {end:.2f}")
        i = max(bisect.bisect_right(times, start) - 1, 0)
        j = min(bisect.bisect_left(times, end), len(times) - 1)
        first = self._samples[i][1]
        spent: dict[int, tuple[str, float]] = {}
        for k in range(i, j + 1):  # a process's latest reading inside the window
            for pid, (role, cpu) in self._samples[k][1].items():
                spent[pid] = (role, cpu - first.get(pid, (role, 0.0))[1])
        by_role: dict[str, float] = {}
        for pid, (role, cpu) in spent.items():
            key = role if not role.startswith("other") else "other"
            by_role[key] = by_role.get(key, 0.0) + max(cpu, 0.0)
        return CpuWindow(self._samples[j][0] - self._samples[i][0], self.cores, by_role)
