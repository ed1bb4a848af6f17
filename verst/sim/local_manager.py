"""The rollout manager of a simulated run: the real `RolloutManager` (router, data source, rollout fn, buffer,
fully async worker) on an event loop of its own, in a thread of the driver's process, behind the handle an RL
run uses (`RolloutSource`, as `RolloutManagerHandle` is). `actor.<method>.remote(...)` reaches it the way the
engine supervisor reaches a Ray actor. Without Ray the driver's process holds a thousand engines' control plane
(a Ray start and a process per part would cost what this machine's two cores need for the measurement).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any

from verst.orchestration import TrainBatchRef
from verst.rollout.manager import PartsFactory, RolloutManager, RouterSpec


class _Call:
    """`actor.<method>.remote(*args)`: a reference whose `future()` is the call's concurrent future."""

    def __init__(self, handle: LocalRolloutManager, method: str):
        self.handle, self.method = handle, method

    def remote(self, *args: Any) -> _Ref:
        return _Ref(self.handle.submit(getattr(self.handle.manager, self.method)(*args)))


class _Ref:
    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def future(self) -> concurrent.futures.Future:
        return self._future


class _Actor:
    def __init__(self, handle: LocalRolloutManager):
        self._handle = handle

    def __getattr__(self, method: str) -> _Call:
        return _Call(self._handle, method)


class LocalRolloutManager:
    """`start(urls)` starts the router and builds the parts; blocking calls with a timeout, as the Ray handle."""

    def __init__(self, parts_factory: PartsFactory, *, router: RouterSpec | None, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="verst-sim-rollout-manager", daemon=True)
        self.thread.start()
        self.thread_id: int | None = self.submit(_native_id()).result(10.0)
        self.manager = self.submit(_build(parts_factory, router)).result(60.0)
        self.actor = _Actor(self)
        self.router_url: str | None = None
        self.pids: dict[str, int | None] = {}
        self.node = self.node_id = None  # this machine (the run's process survey reads /proc here)
        self.unfinished = 0  # groups the fully async worker handed back unfinished when it stopped
        self._closed = False

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        if self._closed:
            raise RuntimeError(f"the rollout manager is shut down; cannot {method}")
        return self.submit(getattr(self.manager, method)(*args)).result(timeout_s or self.timeout_s)

    def start(self, engine_urls: list[str], teacher_urls: list[str] | None = None) -> str | None:
        self.router_url = self.call("start", engine_urls, teacher_urls)
        self.pids = self.call("pids")
        return self.router_url

    # ---- RolloutSource -------------------------------------------------------------------------
    def generate_train_batch(self, rollout_id: int, weight_version: int) -> tuple[TrainBatchRef, dict[str, float]]:
        groups, (count, metrics) = self.call("generate_train_batch", rollout_id, weight_version)
        return TrainBatchRef(groups, count), metrics

    def start_async(self) -> None:
        self.call("start_async")

    def take_batch(self, n: int, version: int, timeout: float | None = None,
                   ) -> tuple[TrainBatchRef, dict[str, float] | None]:
        groups, (count, metrics) = self.call("take_batch", n, version, timeout,
                                             timeout_s=self.timeout_s if timeout is None else timeout + 30.0)
        return TrainBatchRef(groups, count), metrics

    def progress(self) -> str:
        return self.call("progress")

    def stop_async(self) -> int:
        handed_back = self.call("stop_async")
        self.unfinished += handed_back
        return handed_back

    def save_state(self, path: str) -> dict[str, int]:
        return self.call("save_state", path)

    def load_state(self, path: str) -> None:
        self.call("load_state", path)

    def shutdown(self, grace_s: float = 30.0) -> int:
        """Stop the worker, the parts and the router; then the loop. Returns the unfinished groups handed back."""
        if self._closed:
            return 0
        self._closed = True
        try:
            handed_back = self.submit(self.manager.shutdown()).result(grace_s)
            self.unfinished += handed_back
            return handed_back
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10.0)


async def _build(parts_factory: PartsFactory, router: RouterSpec | None) -> RolloutManager:
    return RolloutManager(None, parts_factory, router=router)  # made on its loop: its events belong there


async def _native_id() -> int:
    return threading.get_native_id()
