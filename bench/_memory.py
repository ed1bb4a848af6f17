"""Peak resident memory (VmHWM) of a bench's processes: this one, its children, and the Ray actors and
engine servers below it, each named by its role (trainer rank, engine, rollout manager, driver)."""

from __future__ import annotations

import resource
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

# Substrings of a process's command line (Ray sets an actor's to "ray::<Class>.<method>") -> its role.
ROLES = (("--side trl", "TRL process"), ("--side fully_async", "verst driver (fully async)"),
         ("--side sync", "verst driver (sync)"),
         ("verst.engine.server", "engine server"), ("serve engine", "engine server"),
         ("ray::TrainerRank", "trainer rank"), ("ray::EngineServer", "engine actor"),
         ("ray::_RolloutManagerActor", "rollout manager"), ("ray::RolloutManager", "rollout manager"),
         ("gcs_server", "ray gcs"), ("raylet/raylet", "ray raylet"))


def peak_rss_mib(pid: int | None = None) -> float:
    """A process's peak resident set (VmHWM) in MiB; this process's own when `pid` is None."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def role_of(cmdline: str) -> str:
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    return "other: " + cmdline[:40]


class PeakMemory:
    """Polls every process below this one (Ray's workers and their children included) until stopped and
    keeps each one's latest VmHWM, a peak that only grows, so the last reading before a process exits is
    its peak up to then. `with PeakMemory() as mem: ...; print(mem.table())`."""

    def __init__(self, interval_s: float = 0.5, label: str = "driver"):
        self.interval_s, self.label = interval_s, label
        self.peaks: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval_s)

    def poll(self) -> None:
        for proc in psutil.Process().children(recursive=True):
            try:
                role = role_of(" ".join(proc.cmdline()))
                peak = peak_rss_mib(proc.pid)
            except (psutil.Error, FileNotFoundError, ProcessLookupError):
                continue
            old_role, old = self.peaks.get(proc.pid, (role, 0.0))
            # an idle Ray worker becomes an actor: keep the role once it is known
            self.peaks[proc.pid] = (old_role if role.startswith("other") else role, max(old, peak))

    def by_role(self) -> dict[str, float]:
        """Peak MiB per role (the largest process of each role), this process as `label`."""
        out = {self.label: peak_rss_mib()}
        for role, peak in self.peaks.values():
            if not role.startswith("other"):
                out[role] = max(out.get(role, 0.0), peak)
        return out

    def table(self) -> str:
        return "peak RSS: " + ", ".join(f"{role} {mib:.0f} MiB" for role, mib in self.by_role().items())


T = TypeVar("T")


def report_peaks(main: Callable[[], T]) -> T:
    """Run a bench's `main` while watching its processes; print each role's peak RSS when it ends."""
    with PeakMemory() as memory:
        try:
            return main()
        finally:
            memory.poll()
            print(memory.table(), flush=True)
