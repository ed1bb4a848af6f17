"""The engine supervisor: polls every engine's `/health` from the driver; an engine that died or stopped
answering is taken out of the router, restarted in place at the current weights, and put back.

With `fault.tolerate_engines = false` (or when no restart is possible) it stops the run instead, through
the watchdog, with the one-screen report of what died or the stacks of what hangs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import ray

from verst.config.schema import FaultConfig, VerstConfig
from verst.orchestration.watchdog import RunFailure, RunProcesses, Watchdog, failure_report
from verst.sync.disk import snapshot_path

RestartWeights = Callable[[], tuple[str, int] | None]
"""() -> (model directory, weight version) a restarted engine serves, or None when engines cannot restart."""


class EngineSupervisor:
    """`async with EngineSupervisor(...) as supervisor:` polls in the background while the run goes on.
    Weight syncs take `lock`, which a restart holds: no push reaches an engine that is being replaced."""

    def __init__(self, fault: FaultConfig, engines: Any, rollout: Any, urls: list[str], processes: RunProcesses,
                 watchdog: Watchdog, restart_weights: RestartWeights):
        self.fault, self.engines, self.rollout, self.urls = fault, engines, rollout, list(urls)
        self.processes, self.watchdog, self.restart_weights = processes, watchdog, restart_weights
        self.lock = asyncio.Lock()
        self.restarts = 0
        self._recovery_s: float | None = None
        self._task: asyncio.Task | None = None
        self._failures = [0] * len(urls)
        self._busy: set[int] = set()  # engines being recovered (the poller and check_now may both find one)

    async def __aenter__(self) -> EngineSupervisor:
        self._task = asyncio.create_task(self._poll(), name="verst-engine-supervisor")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def metrics(self) -> dict[str, float]:
        """`fault/engine_restarts_total` once an engine was restarted, and `fault/recovery_seconds` of the
        restart finished since the previous read."""
        if not self.restarts:
            return {}
        out = {"fault/engine_restarts_total": float(self.restarts)}
        if self._recovery_s is not None:
            out["fault/recovery_seconds"], self._recovery_s = self._recovery_s, None
        return out

    @property
    def restarts_engines(self) -> bool:
        """Whether a failed engine is restarted (rather than stopping the run)."""
        return self.fault.tolerate_engines and self.restart_weights() is not None

    async def check_now(self) -> None:
        """Probe every engine once and restart those found dead (before a weight sync reaches them)."""
        async with self.lock:
            pass  # a restart in progress finishes first
        async with httpx.AsyncClient() as http:
            for index, verdict in enumerate(await self._probe_all(http)):
                if verdict == "dead":
                    await self._recover(index, "its server is not running")

    # ---- polling -------------------------------------------------------------------------------
    async def _poll(self) -> None:
        async with httpx.AsyncClient() as http:
            while True:
                await asyncio.sleep(self.fault.health_interval_s)
                for index, verdict in enumerate(await self._probe_all(http)):
                    self._failures[index] = 0 if verdict == "ok" else self._failures[index] + 1
                    # a dead server is certain at once; an unanswered probe may be a busy moment
                    if verdict == "dead" or self._failures[index] >= self.fault.health_failures:
                        why = "its server is not running" if verdict == "dead" else \
                            f"{self._failures[index]} /health polls in a row went unanswered"
                        self._failures[index] = 0
                        if not await self._recover(index, why):
                            return

    async def _probe_all(self, http: httpx.AsyncClient) -> list[str]:
        timeout = max(5.0, self.fault.health_interval_s)
        return list(await asyncio.gather(*(self._probe(http, url, timeout) for url in self.urls)))

    @staticmethod
    async def _probe(http: httpx.AsyncClient, url: str, timeout: float) -> str:
        """'ok', 'dead' (refused: nothing listens) or 'silent' (no answer in time, or an error status)."""
        try:
            response = await http.get(f"{url}/health", timeout=timeout)
        except httpx.ConnectError:
            return "dead"
        except httpx.TransportError:
            return "silent"
        return "ok" if response.status_code == 200 else "silent"

    # ---- recovery ---------------------------------------------------------------------------------
    async def _recover(self, index: int, why: str) -> bool:
        """Restart engine `index`, or stop the run; whether the run goes on."""
        if index in self._busy:
            return True
        self._busy.add(index)
        try:
            return await self._restart_or_fail(index, why)
        finally:
            self._busy.discard(index)

    async def _restart_or_fail(self, index: int, why: str) -> bool:
        weights = self.restart_weights() if self.fault.tolerate_engines else None
        if weights is None:
            self.watchdog.fail(await self._failure(index, why))
            return False
        url, started = self.urls[index], time.perf_counter()
        model, version = weights
        print(f"[fault] engine {index} ({url}) failed: {why}; restarting it at weight version {version}", flush=True)
        try:
            # Out of the router and killed first, without the lock: a push waiting on a hung engine fails
            # now instead of at its own timeout, and is made again after the restart.
            await _ray(self.rollout.actor.remove_engine.remote(url))
            await asyncio.to_thread(self.engines.halt, index)
            async with self.lock:
                await asyncio.to_thread(self.engines.restart, index, model, version)
                await _check_version(url, version)
                await _ray(self.rollout.actor.add_engine.remote(url))
        except Exception as error:
            self.watchdog.fail(RunFailure(f"run stopped: engine {index} ({url}) failed ({why}) and could not be "
                                          f"restarted: {type(error).__name__}: {str(error)[:500]}"))
            return False
        self.restarts += 1
        self._recovery_s = time.perf_counter() - started
        print(f"[fault] engine {index} ({url}) serves version {version} again after {self._recovery_s:.1f} s",
              flush=True)
        return True

    async def _failure(self, index: int, why: str) -> RunFailure:
        url = self.urls[index]
        note = " (restarting an engine needs sync.transport = 'disk', whose snapshots hold the current weights)" \
            if self.fault.tolerate_engines else " (fault.tolerate_engines = false)"
        cause = RuntimeError(f"engine {index} ({url}) failed: {why}{note}")
        report = await asyncio.to_thread(failure_report, self.processes, cause)
        if report is not None:
            return report
        limit = self.fault.health_interval_s * self.fault.health_failures
        return await self.watchdog.stuck(f"engine {index} ({url}) answering /health", limit,
                                         "fault.health_interval_s x fault.health_failures")


def disk_restart_weights(cfg: VerstConfig, syncer: Any, run_dir: Path) -> tuple[str, int] | None:
    """What a restarted engine loads: the disk transport's snapshot of the engines' version (the source
    model before the first sync). Other transports keep no copy of the weights: engines do not restart."""
    if cfg.sync.transport != "disk":
        return None
    version = syncer.version or 0
    return (str(snapshot_path(run_dir / "weights", version)) if version else cfg.model.path), version


async def _ray(ref: ray.ObjectRef, timeout_s: float = 60.0) -> Any:
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)


async def _check_version(url: str, version: int) -> None:
    """The restarted engine must report the version the others serve before it is admitted."""
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{url}/get_weight_version", timeout=30.0)
        response.raise_for_status()
        served = str(response.json()["weight_version"])
    if served != str(version):
        raise RuntimeError(f"the restarted engine at {url} serves weight version {served}, not {version}")

