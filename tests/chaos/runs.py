"""Helpers of the chaos tests: an RL run in a background thread of the test process, and the pids of
its processes from the run directory's `processes.json`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

from verst.monitor import read_metrics
from verst.schedules import SCHEDULES


class BackgroundRun:
    """`SCHEDULES[cfg.schedule](cfg)` in a daemon thread; `result()` returns its summary or raises its error."""

    def __init__(self, cfg):
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.summary, self.error = None, None
        self.thread = threading.Thread(target=self._run, name="chaos-run", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.summary = asyncio.run(SCHEDULES[self.cfg.schedule](self.cfg))
        except BaseException as error:  # handed to the test by result()
            self.error = error

    def result(self, timeout_s: float = 240.0):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the run did not end within {timeout_s:g} s"
        if self.error is not None:
            raise self.error
        return self.summary

    def wait_for_step(self, step: int, timeout_s: float = 180.0) -> None:
        """Until train step `step` is logged (or the run ended)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.thread.is_alive():
            if (self.run_dir / "metrics.jsonl").exists() and any(
                    r.get("step", 0) >= step and "train/loss" in r for r in read_metrics(self.run_dir)):
                return
            time.sleep(0.2)
        raise AssertionError(f"train step {step} was not logged within {timeout_s:g} s (error: {self.error!r})")

    def pid_of(self, name_prefix: str) -> int:
        """The pid `processes.json` lists for the first process whose name starts with `name_prefix`."""
        for entry in json.loads((self.run_dir / "processes.json").read_text()):
            if entry["name"].startswith(name_prefix) and entry["pid"]:
                return int(entry["pid"])
        raise AssertionError(f"no process named {name_prefix!r} in processes.json")


def signal_quietly(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
