"""One simulated inference engine: continuous batching in simulated time. Requests wait until the KV cache
holds them (prompt + the tokens they will sample) and `max_running` allows, then decode together; a step
costs what the latency model says for its batch and context, new prompt tokens add their prefill, and a
prefix already cached on the engine (the session's, or a group's shared prompt) costs nothing.

Time advances by events, not by steps: the engine sleeps until its next request finishes or something
arrives, and counts how many steps fit in the time that passed. Pause, flush, weight loads, versions and
faults (stall, slow) follow the embedded engine's semantics. Plain asyncio: the HTTP face is `http.py`.
"""

from __future__ import annotations

import asyncio
import collections
import zlib
from typing import Any

from verst.inference_client.protocol import WEIGHT_UPDATE_ABORT, is_sample_of
from verst.sim.clock import SimClock
from verst.sim.latency import EngineCosts
from verst.sim.outputs import OutputModel

PREFIX_ENTRIES = 8192  # prefixes an engine remembers (least recently used go first)
PAUSE_MODES = ("abort", "retract", "in_place")


class SimRequest:
    __slots__ = ("rid", "prompt_len", "cached", "target", "finish", "seed", "generated", "future", "oldest",
                 "prefix_key", "return_logprob", "prefill_left")

    def __init__(self, rid: str, prompt_len: int, target: int, finish: str, seed: int, prefix_key: Any,
                 return_logprob: bool, future: asyncio.Future):
        self.rid, self.prompt_len, self.target, self.finish, self.seed = rid, prompt_len, target, finish, seed
        self.prefix_key, self.return_logprob, self.future = prefix_key, return_logprob, future
        self.cached = self.generated = 0
        self.prefill_left = 0  # prompt tokens to prefill when admitted (all but the cached ones)
        self.oldest: str | None = None  # the weight version that sampled its first token

    @property
    def kv_tokens(self) -> int:
        return self.prompt_len + self.generated


class EngineRefused(ValueError):
    """A request the engine's state refuses (400), naming the field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class SimEngine:
    """`index`: its place in the fleet; `version`: the weight version it starts with."""

    def __init__(self, index: int, costs: EngineCosts, clock: SimClock, outputs: OutputModel, *, version: str = "0",
                 max_running: int = 256):
        self.index, self.costs, self.clock, self.outputs = index, costs, clock, outputs
        self.capacity, self.max_running = costs.kv_capacity_tokens, max_running
        self.weight_version = version
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.by_rid: dict[str, SimRequest] = {}
        self.prefixes: collections.OrderedDict[Any, int] = collections.OrderedDict()
        self.kv_reserved = 0
        self.paused: str | None = None  # the pause mode while paused
        self.slow_factor = 1.0
        self.unstalled = asyncio.Event()
        self.unstalled.set()
        self.started = clock.now()
        self.busy_s = 0.0
        self.batch_s = 0.0  # ∫ batch size dt while busy: the mean batch is batch_s / busy_s
        self.paused_s = 0.0  # time paused (a weight push): the engine could not be busy
        self._paused_at: float | None = None
        self._decoding: tuple[float, int] | None = None  # the decode under way: since when, with what batch
        self.finished = self.aborted = self.loads = 0
        self.loaded_bytes = 0.0
        self._waiter: asyncio.Future | None = None
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-engine-{index}")

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, input_ids: list[int], params: dict[str, Any], rid: str, return_logprob: bool,
                       routing_key: str | None) -> dict[str, Any]:
        """The SGLang reply of one generation (an aborted one ends with finish_reason "abort")."""
        max_new = int(params.get("max_new_tokens", 128))
        if not input_ids:
            raise EngineRefused("input_ids is empty", "input_ids")
        seed = self.outputs.seed_of(input_ids, params)
        target, finish = self.outputs.length(seed, max_new) if max_new > 0 else (0, "length")
        if len(input_ids) + target > self.capacity:
            raise EngineRefused(f"prompt ({len(input_ids)}) + max_new_tokens needs {len(input_ids) + target} tokens of "
                                f"KV cache, more than the engine's {self.capacity}", "input_ids")
        key = routing_key if routing_key else zlib.crc32(bytes(str(input_ids[:32]), "ascii"))
        future = asyncio.get_running_loop().create_future()
        req = SimRequest(rid, len(input_ids), target, finish, seed, key, return_logprob, future)
        cached = min(self.prefixes.get(key, 0), len(input_ids) - 1)
        req.cached, req.prefill_left = cached, len(input_ids) - cached
        self.by_rid[rid] = req
        self.waiting.append(req)
        self._wake()
        try:
            return await future
        except asyncio.CancelledError:  # the client went away: the request ends with it
            self._drop(req)
            raise

    def abort(self, rid: str | None = None, message: str = "aborted by request") -> int:
        """End one request (or every one: `rid` None) now; each answers with finish_reason "abort", its
        output so far and `message` (a weight update's is `WEIGHT_UPDATE_ABORT`, as the embedded engine's)."""
        if rid is None:
            reqs = list(self.by_rid.values())
        elif rid in self.by_rid:
            reqs = [self.by_rid[rid]]
        else:  # every sample of a request with sampling_params.n > 1
            reqs = [r for key, r in self.by_rid.items() if is_sample_of(key, rid)]
        for req in reqs:
            self._drop(req)
            self._reply(req, aborted=message)
        return len(reqs)

    # ---- control -------------------------------------------------------------------------------
    def pause(self, mode: str) -> int:
        if mode not in PAUSE_MODES:
            raise EngineRefused(f"mode {mode!r} is not one of {PAUSE_MODES}", "mode")
        held = len(self.by_rid)
        if mode == "abort":
            self.abort(message=WEIGHT_UPDATE_ABORT)
        self.paused = mode
        if self._paused_at is None:
            self._paused_at = self.clock.now()
        self._wake()
        return held

    def resume(self) -> None:
        self.paused = None
        if self._paused_at is not None:
            self.paused_s += self.clock.now() - self._paused_at
            self._paused_at = None
        self._wake()

    def flush(self) -> None:
        self.prefixes.clear()

    async def load(self, nbytes: float, version: str | None, flush: bool) -> None:
        """Receive and install `nbytes` of weights (the latency model's load time), then serve `version`."""
        await self.clock.sleep(self.costs.load_s(nbytes) * self.slow_factor)
        self.loads += 1
        self.loaded_bytes += nbytes
        if flush:
            self.flush()
        if version is not None:
            self.weight_version = version

    def stats(self) -> dict[str, Any]:
        """The counters now; busy, batch and paused seconds include the decode or pause under way."""
        now = self.clock.now()
        paused = self.paused_s + (now - self._paused_at if self._paused_at is not None else 0.0)
        busy, batch = self.busy_s, self.batch_s
        if self._decoding is not None:
            since, size = self._decoding
            decoded = self._decoded_until(since, now) - since
            busy, batch = busy + decoded, batch + size * decoded
        return {"running": len(self.running), "waiting": len(self.waiting), "kv_tokens": self.kv_reserved,
                "kv_capacity": self.capacity, "finished": self.finished, "aborted": self.aborted,
                "busy_seconds": busy, "batch_seconds": batch, "paused_seconds": paused,
                "uptime_seconds": now - self.started, "weight_version": self.weight_version, "loads": self.loads,
                "loaded_bytes": self.loaded_bytes}

    def close(self) -> None:
        """Stop the engine: every request it holds ends (the HTTP face drops their connections)."""
        self._task.cancel()
        for req in list(self.by_rid.values()):
            self._drop(req)
            if not req.future.done():
                req.future.cancel()

    # ---- the batch loop ------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await self.unstalled.wait()
            if self.paused is None:
                self._admit()
            if self.paused is not None or not self.running:
                await self._sleep(None)
                continue
            await self._decode()

    async def _decode(self) -> None:
        """Decode until the next request finishes or something arrives; account the steps that fit."""
        batch = len(self.running)
        context = sum(r.kv_tokens for r in self.running)
        steps = min(r.target - r.generated for r in self.running)
        step_s = self.costs.decode_step_s(batch, context + batch * (steps - 1) // 2) * self.slow_factor
        prefill_s = self.costs.prefill_s(sum(r.prefill_left for r in self.running)) * self.slow_factor
        start = self.clock.now()
        self._decoding = (start, batch)
        try:
            await self._sleep(prefill_s + steps * step_s)
        finally:
            self._decoding = None
        elapsed = self._decoded_until(start, self.clock.now()) - start
        self.busy_s += elapsed
        self.batch_s += batch * elapsed
        done_steps = min(steps, int(max(elapsed - prefill_s, 0.0) / step_s + 1e-9)) if step_s > 0 else steps
        for req in self.running:  # prefill is paid once, whether or not a step followed
            req.prefill_left = 0
        if done_steps <= 0:
            return
        still = []
        for req in self.running:
            req.generated += done_steps
            if req.generated >= req.target:
                self._finish(req)
            else:
                still.append(req)
        self.running = still

    def _decoded_until(self, since: float, now: float) -> float:
        """When the decode begun at `since` stopped: `now`, or the start of a pause that came in between (the
        loop wakes a moment after the pause, and a paused engine decodes nothing)."""
        return now if self._paused_at is None else max(since, min(now, self._paused_at))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = req.prompt_len + req.target - req.generated
            if self.running and self.kv_reserved + need > self.capacity:
                return
            self.waiting.popleft()
            self.kv_reserved += need
            if req.oldest is None:
                req.oldest = self.weight_version
            if req.target == 0:  # a prefill only (max_new_tokens = 0)
                self._finish(req)
                continue
            self.running.append(req)

    def _finish(self, req: SimRequest) -> None:
        self.kv_reserved -= req.prompt_len + req.target
        self.by_rid.pop(req.rid, None)
        self.prefixes[req.prefix_key] = req.prompt_len + req.generated
        self.prefixes.move_to_end(req.prefix_key)
        if len(self.prefixes) > PREFIX_ENTRIES:
            self.prefixes.popitem(last=False)
        self.finished += 1
        self._reply(req, aborted=None)

    def _drop(self, req: SimRequest) -> None:
        """Take `req` out of the queue or the batch, freeing its KV reservation."""
        if self.by_rid.pop(req.rid, None) is None:
            return
        if req in self.running:
            self.running.remove(req)
            self.kv_reserved -= req.prompt_len + req.target
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._wake()

    def _reply(self, req: SimRequest, aborted: str | None) -> None:
        """Answer `req`: finished, or `aborted` with that message."""
        if req.future.done():
            return
        if aborted is not None:
            self.aborted += 1
        n = req.generated if aborted is not None else req.target
        ids, logprobs = self.outputs.sample(req.seed, n)
        finish = {"type": "abort", "message": aborted} if aborted is not None else {"type": req.finish}
        if req.finish == "length" and aborted is None:
            finish["length"] = n
        meta: dict[str, Any] = {
            "id": req.rid, "finish_reason": finish, "prompt_tokens": req.prompt_len, "completion_tokens": n,
            "cached_tokens": req.cached, "weight_version": self.weight_version,
            "oldest_weight_version": req.oldest or self.weight_version}
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, ids)]
        req.future.set_result({"text": "", "output_ids": ids, "meta_info": meta})

    # ---- waiting -------------------------------------------------------------------------------
    async def _sleep(self, sim_seconds: float | None) -> None:
        """Until `sim_seconds` pass (None: forever) or `_wake` is called."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if sim_seconds is None else loop.call_later(self.clock.wall(sim_seconds), _settle, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self._waiter is not None:
            _settle(self._waiter)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
