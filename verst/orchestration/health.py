"""The engine supervisor: polls every engine's `/health` from the driver; an engine that died or stopped
answering is taken out of the router, restarted in place at the current weights, and put back.

With `fault.tolerate_engines = false` (or when no restart is possible) it stops the run instead, through
the watchdog, with the one-screen report of what died or the stacks of what hangs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import ray

from verst.config.schema import FaultConfig
from verst.inference_client.fanout import HttpFanout
from verst.inference_client.wire import Reply, WireError
from verst.monitor.diagnosis import error_text
from verst.orchestration.watchdog import RunFailure, RunProcesses, Watchdog, failure_report

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RestartWeights:
    """What a restarted engine loads: a model directory, served as weight `version`, and with LoRA's
    adapter sync the adapter `(name, PEFT directory)` it then loads beside it (multi-LoRA: `adapters`, each)."""

    model: str
    version: int
    adapter: tuple[str, str] | None = None
    adapters: tuple[tuple[str, str], ...] = ()

    @property
    def loaded_adapters(self) -> list[tuple[str, str]]:
        return ([self.adapter] if self.adapter is not None else []) + list(self.adapters)


RestartSource = Callable[[], Awaitable[RestartWeights]]


class EngineSupervisor:
    """`async with EngineSupervisor(...) as supervisor:` polls in the background while the run goes on.
    Weight syncs take `lock`, which a restart holds: no push reaches an engine that is being replaced."""

    def __init__(self, fault: FaultConfig, engines: Any, rollout: Any, urls: list[str], processes: RunProcesses,
                 watchdog: Watchdog, restart_weights: RestartSource, served_version: Callable[[], int],
                 on_restart: Callable[[], None] = lambda: None):
        """`restart_weights()`: what a restarted engine loads; `served_version()`: the version the other
        engines serve; `on_restart()`: told once an engine was replaced (the weight push reconnects)."""
        self.fault, self.engines, self.rollout, self.urls = fault, engines, rollout, list(urls)
        self.processes, self.watchdog, self.restart_weights = processes, watchdog, restart_weights
        self.served_version, self.on_restart = served_version, on_restart
        self._waiting: dict[int, tuple[int, float]] = {}  # engine -> (version it serves, restart start)
        self.lock = asyncio.Lock()
        self.restarts = 0
        self._recovered: list[tuple[float, float]] = []  # (restart, outage) seconds of recoveries not yet read
        self.outages = Outages()
        self._task: asyncio.Task | None = None
        self._failures = [0] * len(urls)
        self._answered = [time.perf_counter()] * len(urls)  # each engine's last answer to /health
        self._recovering: dict[int, asyncio.Future] = {}  # the poller and check_now may both find an engine
        self._fanout = HttpFanout(self.urls)
        self._replaced_at: dict[int, float] = {}  # engine -> when its last recovery ended (perf_counter)

    async def __aenter__(self) -> EngineSupervisor:
        self._answered = [time.perf_counter()] * len(self.urls)
        self._task = asyncio.create_task(self._poll(), name="verst-engine-supervisor")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._fanout.close()

    def metrics(self, step_start: float | None = None) -> dict[str, float]:
        """`fault/engine_restarts_total` once an engine was restarted; `fault/recovery_seconds` (the restart)
        and `fault/outage_seconds` (from the engine's last answer to its serving again) of the recoveries
        finished since the previous read (the longest, when several); and `time/engine_outage_s`, the seconds
        since `step_start` (perf_counter) during which an engine was out."""
        out: dict[str, float] = {}
        if step_start is not None:
            overlap = self.outages.within(step_start, time.perf_counter())
            if overlap > 0:
                out["time/engine_outage_s"] = overlap
        if not self.restarts:
            return out
        out["fault/engine_restarts_total"] = float(self.restarts)
        if self._recovered:
            restart, outage = max(self._recovered, key=lambda pair: pair[1])
            out["fault/recovery_seconds"], out["fault/outage_seconds"] = restart, outage
            self._recovered = []
        return out

    @property
    def restarts_engines(self) -> bool:
        """Whether a failed engine is restarted (rather than stopping the run)."""
        return self.fault.tolerate_engines

    async def _routers(self, method: str, url: str) -> None:
        """`method(url)` on every rollout manager's router (multi-LoRA: one manager per adapter)."""
        for rollout in self.rollout if isinstance(self.rollout, (list, tuple)) else [self.rollout]:
            await _ray(getattr(rollout.actor, method).remote(url))

    async def admit_synced(self, version: int) -> None:
        """After a push of `version` to every engine (under `lock`): restarted engines that waited for it
        (they were restarted at a newer version than the others served) join the router again."""
        for index, (restarted_at, started) in sorted(self._waiting.items()):
            if version >= restarted_at:
                await _check_version(self.urls[index], version)
                await self._routers("add_engine", self.urls[index])
                del self._waiting[index]
                restart, outage = self._recovered_now(index, started)
                log.info("engine %d (%s) serves version %d with the others again after %.1f s (out for %.1f s)",
                         index, self.urls[index], version, restart, outage)

    def replaced_since(self, moment: float) -> set[int]:
        """The engines whose restart ended after `moment` (perf_counter): each a new server since then."""
        return {index for index, at in self._replaced_at.items() if at > moment}

    async def check_now(self) -> None:
        """Probe every engine once and restart those found dead (before a weight sync reaches them)."""
        async with self.lock:
            pass  # a restart in progress finishes first
        probed = time.perf_counter()
        for index, verdict in enumerate(await self._probe_all()):
            if verdict == "dead" and self._replaced_at.get(index, 0.0) < probed:  # not replaced since the probe
                await self._recover(index, "its server is not running")

    # ---- polling -------------------------------------------------------------------------------
    async def _poll(self) -> None:
        """A poll every `health_interval_s`, each probe answered within that interval or counted as
        unanswered: an engine that stops answering is found within (health_failures + 1) intervals of its
        last answer (health_failures intervals at the least), a dead one at the next poll. Recoveries run
        beside the polling: a restart waits for a weight push to release `lock`, and that push may be waiting
        on a hung engine that only the next polls find."""
        recoveries: set[asyncio.Future] = set()
        try:
            await self._polling(recoveries)
        finally:
            for recovery in recoveries:
                recovery.cancel()  # a restart itself goes on (shielded): a push may wait for it

    async def _polling(self, recoveries: set[asyncio.Future]) -> None:
        interval = self.fault.health_interval_s
        due = time.perf_counter() + interval
        while not any(r.done() and not r.result() for r in recoveries):  # a failed recovery stopped the run
            recoveries -= {r for r in recoveries if r.done()}
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            due += interval
            probed = time.perf_counter()
            for index, verdict in enumerate(await self._probe_all()):
                if index in self._recovering or self._replaced_at.get(index, 0.0) > probed:
                    self._failures[index] = 0  # being replaced, or replaced since this probe: its verdict is old
                    continue
                self._failures[index] = 0 if verdict == "ok" else self._failures[index] + 1
                # a dead server is certain at once; an unanswered probe may be a busy moment
                if verdict == "dead" or self._failures[index] >= self.fault.health_failures:
                    why = "its server is not running" if verdict == "dead" else \
                        f"{self._failures[index]} /health polls in a row went unanswered within " \
                        f"{interval:g} s each (fault.health_interval_s)"
                    self._failures[index] = 0
                    recoveries.add(asyncio.ensure_future(self._recover(index, why, hung=verdict != "dead")))
            due = max(due, time.perf_counter())  # a slow poll is not made up with a burst of polls

    async def _probe_all(self) -> list[str]:
        """Each engine: 'ok', 'dead' (refused: nothing listens) or 'silent' (no answer within the interval, or
        an error status). One request to all over kept connections: a thousand engines are polled every few
        seconds."""
        replies = await self._fanout.call_all("GET", "/health", None, self.fault.health_interval_s)
        verdicts = [_verdict(replies[url]) for url in self.urls]
        now = time.perf_counter()
        for index, verdict in enumerate(verdicts):
            if verdict == "ok":
                self._answered[index] = now
        return verdicts

    # ---- recovery ---------------------------------------------------------------------------------
    async def _recover(self, index: int, why: str, hung: bool = False) -> bool:
        """Restart engine `index`, or stop the run; whether the run goes on. A second caller waits for the
        recovery in progress (a push must not start before the engine is back). `hung`: it stopped answering
        (its stacks, and every other process's, are dumped first)."""
        recovery = self._recovering.get(index)
        if recovery is None:
            self.outages.begin(index, self._answered[index])
            recovery = self._recovering[index] = asyncio.ensure_future(self._restart_or_fail(index, why, hung))
            recovery.add_done_callback(lambda _: self._ended(index))
        return await asyncio.shield(recovery)

    def _ended(self, index: int) -> None:
        self._recovering.pop(index, None)
        self._replaced_at[index] = time.perf_counter()

    async def _restart_or_fail(self, index: int, why: str, hung: bool) -> bool:
        if not self.fault.tolerate_engines:
            self.watchdog.fail(await self._failure(index, why))
            return False
        url, started = self.urls[index], time.perf_counter()
        if hung:  # before the kill: a hang's stacks are its only trace
            dump = await asyncio.to_thread(self.watchdog.dump, f"engine {index} hung")
            why += f"; stacks of every verst process: {dump}"
        log.warning("engine %d (%s) failed: %s; restarting it", index, url, why)
        try:
            # Out of the router and killed first, without the lock: a push waiting on a hung engine fails
            # now instead of at its own timeout, and is made again after the restart.
            await self._routers("remove_engine", url)
            await asyncio.to_thread(self.engines.halt, index)
            async with self.lock:
                weights = await self.restart_weights()
                await asyncio.to_thread(self.engines.restart, index, weights.model, weights.version)
                for adapter in weights.loaded_adapters:
                    await _load_adapter(url, *adapter)
                self.on_restart()
                await _check_version(url, weights.version)
                served = self.served_version()
                if weights.version == served:
                    await self._routers("add_engine", url)
                else:  # newer weights than the others serve: it joins them with the next push
                    self._waiting[index] = (weights.version, started)
        except Exception as error:
            log_path = self.processes.log_dir / f"engine-{index}.log"
            self.watchdog.fail(RunFailure(
                f"run stopped: engine {index} ({url}) failed ({why}) and could not be restarted: "
                f"{error_text(error)}\n  its log: {log_path}; look there for why its server did not start "
                "again, or set fault.tolerate_engines = false to stop at the first engine failure",
                dead=(f"engine-{index}",)))
            return False
        self.restarts += 1
        if index not in self._waiting:
            restart, outage = self._recovered_now(index, started)
            log.info("engine %d (%s) serves version %d again after %.1f s (out for %.1f s)", index, url,
                     weights.version, restart, outage)
        else:
            log.info("engine %d (%s) restarted at version %d; it rejoins the router with the next weight push "
                     "(the others serve %d)", index, url, weights.version, served)
        return True

    def _recovered_now(self, index: int, restart_started: float) -> tuple[float, float]:
        """Engine `index` serves again: (its restart's seconds, its outage's), kept for `metrics`."""
        now = time.perf_counter()
        pair = (now - restart_started, now - self.outages.end(index, now))
        self._recovered.append(pair)
        return pair

    async def _failure(self, index: int, why: str) -> RunFailure:
        url = self.urls[index]
        cause = RuntimeError(f"engine {index} ({url}) failed: {why} (fault.tolerate_engines = false)")
        report = await asyncio.to_thread(failure_report, self.processes, cause)
        if report is not None:
            return report
        limit = self.fault.health_interval_s * self.fault.health_failures
        return await self.watchdog.stuck(f"engine {index} ({url}) answering /health", limit,
                                         "fault.health_interval_s x fault.health_failures")


def _verdict(reply: Reply | Exception) -> str:
    if isinstance(reply, WireError) and reply.refused:
        return "dead"
    if isinstance(reply, Exception):
        return "silent"
    return "ok" if reply.status_code == 200 else "silent"


class Outages:
    """When each engine was out: from its last answer to /health to its serving again (perf_counter)."""

    def __init__(self) -> None:
        self.windows: list[tuple[int, float, float | None]] = []  # (engine, start, end: None while out)

    def begin(self, index: int, last_answer: float) -> None:
        self.windows.append((index, last_answer, None))

    def end(self, index: int, now: float) -> float:
        """Engine `index` serves again at `now`; returns when its outage began."""
        for at, (engine, start, end) in enumerate(self.windows):
            if engine == index and end is None:
                self.windows[at] = (engine, start, now)
                return start
        return now

    def within(self, start: float, stop: float) -> float:
        """Seconds of [start, stop] during which at least one engine was out (overlapping outages once)."""
        spans = sorted((max(s, start), min(e if e is not None else stop, stop)) for _, s, e in self.windows)
        total, reached = 0.0, start
        for a, b in spans:
            a = max(a, reached)
            if b > a:
                total, reached = total + b - a, b
        self.windows = [w for w in self.windows if w[2] is None or w[2] > start]  # ended before: never asked again
        return total


async def _ray(ref: ray.ObjectRef, timeout_s: float = 60.0) -> Any:
    async with asyncio.timeout(timeout_s):
        return await asyncio.wrap_future(ref.future())


async def _load_adapter(url: str, name: str, path: str) -> None:
    """The restarted engine serves the base; the run's requests name the adapter, loaded here."""
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{url}/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                                   timeout=120.0)
    if response.status_code != 200:
        raise RuntimeError(f"the restarted engine at {url} refused adapter {name!r} from {path}: "
                           f"{response.status_code} {response.text}")


async def _check_version(url: str, version: int) -> None:
    """The restarted engine must report the version the others serve before it is admitted."""
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{url}/model_info", timeout=30.0)  # SGLang's route for the version
        response.raise_for_status()
        served = str(response.json()["weight_version"])
    if served != str(version):
        raise RuntimeError(f"the restarted engine at {url} serves weight version {served}, not {version}")

