"""The engine thread: owns the `EngineCore`, runs its steps, and executes commands between steps.

Everything that touches the core (new requests, abort, pause, weight loads) is a command queued here and
run by this one thread, so the core needs no locks and the HTTP event loop never waits on a forward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from verst.engine.core import EngineCore
from verst.engine.request import Request

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineRunner:
    def __init__(self, core: EngineCore, torch_threads: int | None = 1):
        self.core = core
        self.torch_threads = torch_threads  # the forward's threads (`/set_cores` changes them)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.step_errors = 0
        # Seconds spent in forward steps, and when counting began: their ratio over an interval is the
        # engine's busy fraction (1 − idle fraction), read through /get_server_info.
        self.busy_seconds = 0.0
        self.started_at = time.monotonic()

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> EngineRunner:
        if self._thread is not None:
            raise RuntimeError("EngineRunner already started")
        self._thread = threading.Thread(target=self._loop, name="verst-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self.call(lambda core: core.abort_all("engine shutting down"))
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- commands ----------------------------------------------------------------------------------
    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Run `fn(core)` on the engine thread between steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._stopping:
            future.set_exception(RuntimeError("the engine is shutting down"))
            return future
        self._commands.put((fn, future))
        self._wake.set()
        return future

    async def acall(self, fn: Callable[[EngineCore], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    async def generate(self, req: Request) -> Request:
        """Submit and wait until finished; cancelling the awaiting task aborts the request."""
        return (await self.generate_many([req]))[0]

    async def generate_many(self, reqs: list[Request]) -> list[Request]:
        """Submit `reqs` together and wait until every one is finished (a batched `/generate`): one
        command adds them all and one wake-up of this event loop follows the last to finish, where a
        request at a time would cost a command, a future and a wake-up each, on the engine thread too.
        If one cannot be added, none stays; cancelling the awaiting task aborts those still running."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[Request]] = loop.create_future()
        remaining = len(reqs)

        def finished(_: Request) -> None:  # on the engine thread, which alone counts down
            nonlocal remaining
            remaining -= 1
            if remaining == 0:
                loop.call_soon_threadsafe(_resolve, done, reqs)

        for req in reqs:
            req.on_finish = finished
        await self.acall(lambda core: _add_all(core, reqs))
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            self.call(lambda core: [core.abort(req.rid, "client went away") for req in reqs])
            raise

    async def stream(self, req: Request) -> AsyncIterator[int]:
        """Submit and yield the number of output tokens after each new token, the last one once finished."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        req.on_token = lambda r: loop.call_soon_threadsafe(updates.put_nowait, (len(r.output_ids), False))
        req.on_finish = lambda r: loop.call_soon_threadsafe(updates.put_nowait, (len(r.output_ids), True))
        await self.acall(lambda core: core.add_request(req))
        try:
            while True:
                n, final = await updates.get()
                yield n
                if final:
                    return
        finally:
            if not req.finished:
                self.call(lambda core: core.abort(req.rid, "client went away"))

    # ---- the thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)
        while not self._stopping:
            self._wake.clear()
            self._run_commands()
            if self.core.has_work():
                self._step()
            else:
                self._wake.wait(timeout=1.0)
        self._run_commands()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.core))
            except BaseException as exc:  # the caller gets the error; the engine carries on
                future.set_exception(exc)

    def _step(self) -> None:
        start = time.monotonic()
        try:
            self.core.step()
        except Exception as exc:
            # A failed forward must not wedge the engine: end every in-flight request with the error and
            # keep serving; the count is reported by /get_server_info.
            self.step_errors += 1
            log.exception("engine step failed; aborting in-flight requests")
            message = f"engine step failed: {type(exc).__name__}: {exc}"
            try:
                self.core.abort_all(message)
            except Exception:
                log.exception("abort after a failed step also failed; dropping all requests and the KV cache")
                self.core.reset(message)
        finally:
            self.busy_seconds += time.monotonic() - start


def _add_all(core: EngineCore, reqs: list[Request]) -> None:
    """Add every request, or none: those added before one is refused are aborted, then the error raised."""
    added = []
    try:
        for req in reqs:
            core.add_request(req)
            added.append(req)
    except BaseException:
        for req in added:
            req.on_finish = None  # the caller gets the error, not a half-finished batch
            core.abort(req.rid, "another request of its batch was refused")
        raise


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
