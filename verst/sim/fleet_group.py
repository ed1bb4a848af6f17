"""The driver's handle of the simulated fleet: fleet processes started on loopback, each serving a share of the
engines, and the calls `EngineActorGroup` offers the engine supervisor (`halt`, `restart`, `status`, `infos`,
`health`), plus faults on demand and every engine's counters. Blocking calls, as the actor group's are.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from verst.router.manager import open_files_limit
from verst.sim.fleet import FleetSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Process:
    proc: subprocess.Popen
    control: str  # its control server's URL
    first: int
    count: int


class SimFleetGroup:
    """`processes` fleet processes sharing `spec.count` engines; `log_dir` gets each one's output."""

    def __init__(self, spec: FleetSpec, *, processes: int = 1, log_dir: Path | None = None,
                 startup_timeout_s: float = 120.0):
        if not 1 <= processes <= spec.count:
            raise ValueError(f"sim.fleet_processes = {processes} must be between 1 and the {spec.count} engines")
        self.spec, self.log_dir, self.startup_timeout_s = spec, log_dir, startup_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="verst-sim-fleet-")
        self._processes: list[_Process] = []
        self._urls: list[str] = []
        self._http = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0))
        try:
            self._start(processes)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, processes: int) -> None:
        open_files_limit()  # each fleet process, inheriting it, holds its engines' listeners and their requests
        share, extra = divmod(self.spec.count, processes)
        launched, first = [], 0
        for p in range(processes):
            count = share + (p < extra)
            spec = dataclasses.replace(self.spec, count=count, first=first)
            port_file = Path(self._tmp.name) / f"fleet-{p}.json"
            log = open(self.log_dir / f"sim-fleet-{p}.log", "ab") if self.log_dir else subprocess.DEVNULL
            proc = subprocess.Popen([sys.executable, "-m", "verst.sim.fleet", "--spec",
                                     json.dumps(dataclasses.asdict(spec)), "--port-file", str(port_file)],
                                    stdout=log, stderr=subprocess.STDOUT)
            if log is not subprocess.DEVNULL:
                log.close()
            launched.append((proc, port_file, first, count))
            first += count
        for proc, port_file, first, count in launched:
            ports = self._wait_for(proc, port_file)
            self._processes.append(_Process(proc, f"http://{self.spec.host}:{ports['control']}", first, count))
            self._urls += [f"http://{self.spec.host}:{port}" for port in ports["engines"]]

    def _wait_for(self, proc: subprocess.Popen, port_file: Path) -> dict[str, Any]:
        deadline = time.monotonic() + self.startup_timeout_s
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"a sim fleet process exited with code {proc.returncode} at start-up"
                                   + (f"; see {self.log_dir}" if self.log_dir else ""))
            if time.monotonic() > deadline:
                raise TimeoutError(f"a sim fleet process did not listen within {self.startup_timeout_s:g} s")
            time.sleep(0.05)
        return json.loads(port_file.read_text())

    # ---- what the run reads ----------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    @property
    def pids(self) -> list[int]:
        return [p.proc.pid for p in self._processes]

    @property
    def infos(self) -> list[dict[str, Any]]:
        """Per engine, as `EngineActorGroup.infos`: its server is the fleet process that hosts it."""
        return [{"index": i, "url": url, "server_pid": self._owner(i).proc.pid, "actor_pid": None,
                 "placement_group": None, "bundle": None, "node": None, "node_id": None}
                for i, url in enumerate(self._urls)]

    def wait_ready(self) -> SimFleetGroup:
        return self

    def status(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Per engine: the hosting process's pid and return code (None while it runs)."""
        return [{"index": i, "server_pid": self._owner(i).proc.pid, "returncode": self._owner(i).proc.poll()}
                for i in range(len(self._urls))]

    def health(self) -> dict[str, bool]:
        states = {s["index"]: s["state"] for s in self.stats()}
        return {url: states.get(i) == "up" for i, url in enumerate(self._urls)}

    def stats(self) -> list[dict[str, Any]]:
        """Every engine's counters (state, busy and up seconds, requests, loads), by index."""
        out: list[dict[str, Any]] = []
        for process in self._processes:
            out += self._control(process, "/stats", None)
        return out

    # ---- faults and recovery ----------------------------------------------------------------------
    def fault(self, index: int, kind: str, factor: float = 1.0) -> None:
        """Put engine `index` into a fault: die, stall, slow (by `factor`), refuse_loads, or heal."""
        self._control(self._owner(index), "/fault", {"index": index, "kind": kind, "factor": factor})

    def halt(self, index: int, timeout_s: float = 15.0) -> None:
        self._control(self._owner(index), "/halt", {"index": index})

    def restart(self, index: int, model: str, version: int) -> dict[str, Any]:
        """A new engine at the same URL serving weight `version` (the latency model's start-up time first)."""
        self._control(self._owner(index), "/restart", {"index": index, "version": str(version), "model": model})
        return self.infos[index]

    def release_memory(self) -> list[bool]:
        return [False] * len(self._urls)  # simulated engines hold no device memory a colocated trainer needs

    def resume_memory(self) -> list[bool]:
        return [False] * len(self._urls)

    def shutdown(self) -> None:
        for process in self._processes:
            if process.proc.poll() is None:
                process.proc.terminate()
        for process in self._processes:
            try:
                process.proc.wait(10)
            except subprocess.TimeoutExpired:
                process.proc.kill()
                process.proc.wait(5)
        self._processes = []
        self._http.close()
        self._tmp.cleanup()

    def __enter__(self) -> SimFleetGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals --------------------------------------------------------------------------------
    def _owner(self, index: int) -> _Process:
        for process in self._processes:
            if process.first <= index < process.first + process.count:
                return process
        raise IndexError(f"engine index {index} is not in this fleet of {len(self._urls)}")

    def _control(self, process: _Process, path: str, body: Any) -> Any:
        response = self._http.post(process.control + path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"sim fleet control {path} {body}: {response.status_code} {response.text[:300]}")
        return response.json()
