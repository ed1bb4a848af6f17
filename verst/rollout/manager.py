"""The rollout manager: owns the router in front of the engines and hosts the rollout side (data
source, rollout fn, buffer, fully async worker), which a parts factory builds once the router is up.

`RolloutManager` is a plain class (async methods, testable without Ray); the orchestration runs it as
an async Ray actor (`verst.orchestration`) so the fully async worker lives on the actor's event loop across
training steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import os
import pickle
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from verst.rollout.buffer import DataBuffer
from verst.rollout.worker import AsyncRolloutWorker
from verst.router import RouterManager
from verst.types import Group

GenerateBatch = Callable[[int, int], Awaitable[list[Group]]]
"""`async generate_batch(rollout_id, weight_version) -> groups`: one rollout step (the rollout fn)."""
BatchSummary = tuple[int, dict[str, float]]
"""(groups in a train batch, its metrics): what the driver reads of a train batch."""


@dataclasses.dataclass(frozen=True)
class RolloutEndpoints:
    """Where the rollout side sends work: the router (None without one) and every engine directly; the
    teacher's engines (on-policy distillation; empty without a teacher), addressed directly."""

    router_url: str | None
    engine_urls: list[str]
    teacher_urls: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RolloutParts:
    """What a parts factory hands the manager. `generate_batch` serves the sync and one-step-off
    schedules, `worker` (with its `buffer`) the fully async one; `source` is saved and restored with
    the run; `close` runs at shutdown; `metrics` returns (and resets) the parts' own metrics, e.g. those
    of the last rollout step; `batch_metrics(groups)` gives the metrics of the groups of one train batch
    taken from the buffer (the fully async path, whose rollout steps are single groups);
    `record_batch(groups, rollout_id, version)` sees every train batch: a rollout step's (with its id) or
    a fully async batch (id None) taken at trainer `version` (e.g. to log sample generations); `progress()`
    says what the fully async worker made of its groups so far, for a trainer waiting on them."""

    generate_batch: GenerateBatch | None = None
    worker: AsyncRolloutWorker | None = None
    buffer: DataBuffer | None = None
    source: Any = None  # a verst.data.DataSource
    close: Callable[[], Awaitable[None]] | None = None
    metrics: Callable[[], dict[str, float]] | None = None
    batch_metrics: Callable[[list[Group]], dict[str, float]] | None = None
    record_batch: Callable[[list[Group], int | None, int], None] | None = None
    progress: Callable[[], str] | None = None  # fully async: what the worker made of its groups so far
    # held-out scoring on the rollout side, (weight version) -> eval/ metrics: an image run's (its reward lives here)
    evaluate: Callable[[int], Awaitable[dict[str, float]]] | None = None


PartsFactory = Callable[[RolloutEndpoints], RolloutParts | Awaitable[RolloutParts]]
"""`factory(endpoints) -> RolloutParts` (or a coroutine of it); picklable when run in an actor."""


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """sglang-router settings: manual + min_load pins sessions (`X-SMG-Routing-Key`) to the engine
    holding their prefix; a load policy (`power_of_two`, `round_robin`) suits single-turn work."""

    policy: str = "manual"
    assignment_mode: str = "min_load"
    log_path: str | None = None
    max_requests: int | None = None  # the rollout side's requests at once (rollout.concurrency)


class RolloutManager:
    """Host of the rollout side. Call `start()` first and `shutdown()` last (both idempotent).

    `engine_urls` may come late, to `start()`: an actor created before the engines are up does its
    imports (the parts factory's modules) while they start, and runs `prepare()` (in a thread, at once):
    the slow part of building the parts that needs no engine, e.g. loading the tokenizer. `start()`
    waits for it and raises its error."""

    def __init__(
        self, engine_urls: list[str] | None, parts_factory: PartsFactory, *, router: RouterSpec | None = RouterSpec(),
        prepare: Callable[[], Any] | None = None,
    ):
        self._engine_urls = _checked_urls(engine_urls) if engine_urls is not None else None
        self._factory, self._router_spec = parts_factory, router
        self._router: RouterManager | None = None
        self._parts: RolloutParts | None = None
        self._async_started = False
        self._taken: list[Group] = []  # the fully async train batch being assembled by take_batch
        self._taken_version = 0  # the trainer's version when it was taken
        self._closed = False
        self._batch_start: dict[str, Any] | None = None  # the source's position before the batch generating
        self._prepared: concurrent.futures.Future | None = None
        if prepare is not None:
            self._prepared = concurrent.futures.Future()
            threading.Thread(target=_run_into, args=(prepare, self._prepared), name="verst-rollout-prepare",
                             daemon=True).start()

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, engine_urls: list[str] | None = None, teacher_urls: list[str] | None = None) -> str | None:
        """Start the router (unless `router=None`), then build the parts; returns the router URL.
        `teacher_urls`: the teacher's engines, for the parts (on-policy distillation)."""
        if engine_urls is not None:
            urls = _checked_urls(engine_urls)
            if self._engine_urls is not None and urls != self._engine_urls:
                raise ValueError(f"RolloutManager.start: engine_urls {urls} differ from the {self._engine_urls} "
                                 "it was given before")
            self._engine_urls = urls
        if self._engine_urls is None:
            raise ValueError("RolloutManager needs at least one engine URL: pass engine_urls to the constructor "
                             "or to start()")
        if self._parts is not None:
            return await self.router_url()
        if self._prepared is not None:
            await asyncio.wrap_future(self._prepared)
        if self._router_spec is not None:
            spec = self._router_spec
            self._router = RouterManager(self._engine_urls, policy=spec.policy, assignment_mode=spec.assignment_mode,
                                         log_path=Path(spec.log_path) if spec.log_path else None,
                                         max_requests=spec.max_requests)
            await asyncio.to_thread(self._router.start)
        try:
            built = self._factory(RolloutEndpoints(await self.router_url(), list(self._engine_urls),
                                                   list(teacher_urls or [])))
            parts = await built if inspect.isawaitable(built) else built
            if not isinstance(parts, RolloutParts):
                raise TypeError(f"the rollout parts factory returned {type(parts).__name__}; expected RolloutParts")
            if parts.worker is not None and parts.buffer is None:
                raise ValueError("RolloutParts.worker needs the buffer it puts into (RolloutParts.buffer)")
            self._parts = parts
        except BaseException:
            await self.shutdown()
            raise
        return await self.router_url()

    async def shutdown(self) -> int:
        """Stop the worker (its leftovers go to its `on_leftover`), close the parts, stop the router.
        Returns the number of leftover groups."""
        if self._closed:
            return 0
        self._closed = True
        leftovers = 0
        try:
            if self._parts is not None and self._async_started:
                leftovers = len(await self._parts.worker.stop())
            if self._parts is not None and self._parts.close is not None:
                await self._parts.close()
        finally:
            if self._router is not None:
                await asyncio.to_thread(self._router.stop)
        return leftovers

    # ---- the sync and one-step-off schedules ----------------------------------------------
    async def generate_batch(self, rollout_id: int, weight_version: int) -> list[Group]:
        parts = self._ready("generate_batch")
        if parts.generate_batch is None:
            raise RuntimeError("generate_batch: the rollout parts have no generate_batch (a fully async set-up?)")
        if self._async_started:
            raise RuntimeError("generate_batch: the fully async worker is running; take groups with take()")
        # A checkpoint taken meanwhile (one-step-off) saves the position before this batch: a resumed run
        # generates it again.
        self._batch_start = parts.source.state_dict() if parts.source is not None else None
        try:
            return await parts.generate_batch(rollout_id, weight_version)
        finally:
            self._batch_start = None

    # ---- the fully async schedule --------------------------------------------------------
    async def start_async(self) -> None:
        """Start the background worker on this event loop; it generates until `stop_async`/`shutdown`."""
        worker = self._worker("start_async")
        if self._async_started:
            raise RuntimeError("start_async: the fully async worker is already running")
        worker.start()
        self._async_started = True

    async def take(self, n: int, version: int, timeout: float | None = None) -> list[Group]:
        """Up to n fresh groups for trainer version `version` (the buffer's staleness rule applies)."""
        worker = self._worker("take")
        if not self._async_started:
            raise RuntimeError("take: the fully async worker is not running (call start_async first)")
        return await worker.take(n, version, timeout)

    async def pause(self) -> None:
        """Start no new group (in-flight ones finish); engine-level pause is the weight sync's job."""
        self._worker("pause").pause()

    async def resume(self) -> None:
        self._worker("resume").resume()

    async def stop_async(self) -> int:
        """Stop the worker; returns how many unfinished groups it handed to its `on_leftover`."""
        worker = self._worker("stop_async")
        if not self._async_started:
            return 0
        self._async_started = False
        return len(await worker.stop())

    # ---- train batches: the groups stay on this side until the trainer ranks fetch them --------------
    async def generate_train_batch(self, rollout_id: int, weight_version: int) -> tuple[list[Group], BatchSummary]:
        """One rollout step's groups and their summary (`metrics` read right after the step)."""
        groups = await self.generate_batch(rollout_id, weight_version)
        self._record(groups, rollout_id, weight_version)
        return groups, (len(groups), await self.metrics())

    async def take_batch(self, n: int, version: int, timeout: float | None = None,
                         ) -> tuple[list[Group], tuple[int, dict[str, float] | None]]:
        """Fully async: fresh groups (see `take`) into the train batch assembled here, waiting at most `timeout`
        for them. Once it holds n: its groups and summary, and a new batch begins (one call a train step when
        groups are ready). Before: no groups, and how many it holds with no metrics (call again)."""
        if len(self._taken) < n:
            self._taken.extend(await self.take(n - len(self._taken), version, timeout))
        self._taken_version = version
        if len(self._taken) < n:
            return [], (len(self._taken), None)
        return await self._hand_over()

    async def progress(self) -> str:
        """Fully async: what the worker made of its groups so far (finished, dropped by reason, generating),
        without resetting any metric window; empty when the parts say nothing."""
        parts = self._ready("progress")
        return parts.progress() if parts.progress is not None else ""

    async def _hand_over(self) -> tuple[list[Group], BatchSummary]:
        """The train batch `take_batch` assembled (a new one begins) and its summary: `metrics` and the parts'
        `batch_metrics` of these groups."""
        parts = self._ready("take_batch")
        groups, self._taken = self._taken, []
        metrics = await self.metrics()
        if parts.batch_metrics is not None:
            metrics.update(parts.batch_metrics(groups))
        self._record(groups, None, self._taken_version)
        return groups, (len(groups), metrics)

    def _record(self, groups: list[Group], rollout_id: int | None, version: int) -> None:
        parts = self._ready("record_batch")
        if parts.record_batch is not None and groups:
            parts.record_batch(groups, rollout_id, version)

    # ---- state and metrics ---------------------------------------------------------------
    async def metrics(self) -> dict[str, float]:
        """The buffer's, the worker's and the parts' metrics (each resets its per-step windows when read)."""
        parts = self._ready("metrics")
        out: dict[str, float] = {}
        if parts.buffer is not None:
            out.update(parts.buffer.metrics())
        if parts.worker is not None:
            out.update(parts.worker.metrics())
        if parts.metrics is not None:
            out.update(parts.metrics())
        return out

    async def evaluate(self, version: int) -> dict[str, float]:
        """The held-out score through the engines, which must serve `version` (`RolloutParts.evaluate`)."""
        parts = self._ready("evaluate")
        if parts.evaluate is None:
            raise RuntimeError("evaluate: the rollout parts score no held-out prompts (RolloutParts.evaluate)")
        return await parts.evaluate(version)

    async def engine_urls(self) -> list[str]:
        return list(self._engine_urls or [])

    async def remove_engine(self, url: str) -> None:
        """Take an engine out of the router (it failed; requests go to the others meanwhile)."""
        if self._router is not None and url.rstrip("/") in self._router.engine_urls:
            await asyncio.to_thread(self._router.remove_engine, url)

    async def add_engine(self, url: str) -> None:
        """Put a restarted engine back behind the router."""
        if self._router is not None and url.rstrip("/") not in self._router.engine_urls:
            await asyncio.to_thread(self._router.add_engine, url)

    async def router_url(self) -> str | None:
        return self._router.url if self._router is not None else None

    async def pids(self) -> dict[str, int | None]:
        """This process and the router's (None without one), for health checks and leak checks."""
        router = self._router.proc.pid if self._router is not None and self._router.proc is not None else None
        return {"manager": os.getpid(), "router": router}

    async def state_dict(self) -> dict[str, Any]:
        """The data source's position, to resume a run from the same prompts."""
        parts = self._ready("state_dict")
        if parts.source is None:
            raise RuntimeError("state_dict: the rollout parts have no data source")
        return parts.source.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = self._ready("load_state_dict")
        if parts.source is None:
            raise RuntimeError("load_state_dict: the rollout parts have no data source")
        parts.source.load_state_dict(state)

    async def save_state(self, path: str) -> dict[str, int]:
        """Write the rollout side's state for a checkpoint to `path` (fsynced): the source's position, the
        buffer's waiting groups and counters, and the fully async worker's counters. Groups not yet in the
        buffer are not waited for: the file records them, and a resumed run serves their prompts again
        (nothing lost, nothing trained twice); the live run keeps them. Returns the counts recorded."""
        state = self._snapshot()
        blob = pickle.dumps(state)  # here, on the loop: the worker changes its groups between awaits
        await asyncio.to_thread(_write_synced, Path(path), blob)
        worker = state.get("worker") or {}
        return {"buffer_groups": len((state.get("buffer") or {}).get("groups", [])),
                "returned_in_flight_groups": len(worker.get("in_flight", []))}

    async def load_state(self, path: str) -> None:
        """Restore what `save_state` wrote, before generation starts: the prompts of groups that were not
        in the buffer go back to the source, the buffer's groups wait there again."""
        parts = self._ready("load_state")
        state = pickle.loads(await asyncio.to_thread(Path(path).read_bytes))
        if parts.source is not None:
            parts.source.load_state_dict(state["source"])
        worker_state = state.get("worker")
        if worker_state is not None and parts.worker is not None:
            parts.worker.load_counters(worker_state["counters"])
            for group in worker_state["in_flight"]:
                parts.source.return_prompts(group)
        if state.get("buffer") is not None and parts.buffer is not None:
            parts.buffer.load_state_dict(state["buffer"])

    # ---- internals -----------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        parts = self._ready("save_state")
        state: dict[str, Any] = {"source": None, "buffer": None, "worker": None}
        if parts.source is not None:
            state["source"] = self._batch_start or parts.source.state_dict()
        if parts.buffer is not None:
            if not hasattr(parts.buffer, "state_dict"):
                raise RuntimeError(f"save_state: the buffer {type(parts.buffer).__name__} has no state_dict(); "
                                   "a checkpoint of a fully async run needs it")
            state["buffer"] = parts.buffer.state_dict()
        if parts.worker is not None:
            state["worker"] = parts.worker.snapshot()
        return state

    def _ready(self, what: str) -> RolloutParts:
        if self._closed:
            raise RuntimeError(f"{what}: the rollout manager is shut down")
        if self._parts is None:
            raise RuntimeError(f"{what}: the rollout manager is not started (call start first)")
        return self._parts

    def _worker(self, what: str) -> AsyncRolloutWorker:
        worker = self._ready(what).worker
        if worker is None:
            raise RuntimeError(f"{what}: the rollout parts have no fully async worker")
        return worker


def _write_synced(path: Path, blob: bytes) -> None:
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def _run_into(fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as error:  # raised to start()'s caller
        future.set_exception(error)


def _checked_urls(engine_urls: list[str]) -> list[str]:
    if not engine_urls:
        raise ValueError(f"RolloutManager needs at least one engine URL, got {engine_urls!r}")
    return [u.rstrip("/") for u in engine_urls]
