"""Fan-out to every engine directly: sglang-router has no weight-update, pause or abort routes.

Each call goes to all engines at once and fails loudly, naming every engine that failed and why. A call whose
request is the same for every engine (pause, continue, flush, the weight loads) is made once by a client and
sent to all through `HttpFanout`: a weight push makes one per engine and bucket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from verst.inference_client.client import EngineClient, Timeouts
from verst.inference_client.fanout import HttpFanout
from verst.inference_client.replies import EngineError, json_or_raise, transport_error_text
from verst.types.cores import CoreShare

T = TypeVar("T")


class FleetError(RuntimeError):
    def __init__(self, action: str, failures: dict[str, BaseException]):
        lines = "; ".join(f"{url}: {transport_error_text(exc)}" for url, exc in failures.items())
        super().__init__(f"{action} failed on {len(failures)} engine(s): {lines}")
        self.failures = failures


class EngineFleet:
    """Clients of a fixed list of engine URLs. `async with EngineFleet(urls) as fleet: await fleet.pause()`."""

    def __init__(self, urls: list[str], timeouts: Timeouts | None = None):
        if not urls:
            raise ValueError("EngineFleet needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.clients = {url: EngineClient(url, timeouts=timeouts) for url in self.urls}
        self.fanout = HttpFanout(self.urls, (timeouts or Timeouts()).connect)
        self._capture = _RequestCapture(self.urls[0], timeouts=timeouts)
        self._in_place: dict[str, bool] = {}  # per engine: replaces a loaded LoRA adapter in place

    async def __aenter__(self) -> EngineFleet:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()), self.fanout.close())

    async def each(self, action: str, fn: Callable[[EngineClient], Awaitable[T]]) -> dict[str, T]:
        """Run `fn` against every engine concurrently; results by URL, or FleetError naming the failures."""
        results = await asyncio.gather(*(fn(c) for c in self.clients.values()), return_exceptions=True)
        failures = {url: r for url, r in zip(self.urls, results) if isinstance(r, BaseException)}
        if failures:
            raise FleetError(action, failures)
        return dict(zip(self.urls, results))  # type: ignore[arg-type]

    async def same(self, action: str, fn: Callable[[EngineClient], Awaitable[Any]]) -> dict[str, Any]:
        """The request `fn(client)` makes, sent to every engine at once (`HttpFanout`); each engine's JSON reply
        by URL, or FleetError naming the failures, as `each`."""
        results = await self.same_settled(fn)
        failures = {url: r for url, r in results.items() if isinstance(r, EngineError)}
        if failures:
            raise FleetError(action, failures)
        return results

    async def same_settled(self, fn: Callable[[EngineClient], Awaitable[Any]]) -> dict[str, Any]:
        """`same`, with each engine's `EngineError` in place of its reply instead of raising."""
        try:
            await fn(self._capture)
            raise AssertionError("the call made no request")
        except _Captured as request:
            method, path, body, timeout = request.args
        replies = await self.fanout.call_all(method, path, body, timeout)
        results: dict[str, Any] = {}
        for url, reply in replies.items():
            try:
                if isinstance(reply, BaseException):
                    raise EngineError(url + path, None, str(reply)) from reply
                results[url] = json_or_raise(reply, url + path)
            except EngineError as error:
                results[url] = error
        return results

    async def pause(self, mode: str = "retract") -> dict[str, Any]:
        return await self.same(f"pause_generation({mode})", lambda c: c.pause(mode))

    async def continue_generation(self) -> dict[str, Any]:
        return await self.same("continue_generation", lambda c: c.continue_generation())

    async def abort_all(self) -> dict[str, Any]:
        return await self.same("abort_all", lambda c: c.abort_all())

    async def flush_cache(self) -> dict[str, Any]:
        return await self.same("flush_cache", lambda c: c.flush_cache())

    async def set_cores(self, shares: list[CoreShare]) -> dict[str, Any]:
        """Engine i computes on `shares[i]` from now on (the embedded engine's `/set_cores`)."""
        if len(shares) != len(self.urls):
            raise ValueError(f"{len(shares)} core shares for {len(self.urls)} engines")
        by_url = dict(zip(self.urls, shares))
        return await self.each("set_cores", lambda c: c.set_cores(list(by_url[c.base_url].cores),
                                                                 by_url[c.base_url].threads))

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> dict[str, Any]:
        return await self.same("update_weights_from_disk",
                               lambda c: c.update_weights_from_disk(model_path, weight_version))

    async def update_weights_from_tensor(self, payloads: Callable[[str], list[str]], weight_version: str | None,
                                         **adapter: Any) -> dict[str, Any]:
        """`payloads(url)`: the `serialized_named_tensors` of the engine at `url`, made for it alone (each
        entry's unpickling gives back a reference of its own, `verst.inference_client.tensor_payload`)."""
        return await self.each("update_weights_from_tensor", lambda c: c.update_weights_from_tensor(
            payloads(c.base_url), weight_version, **adapter))

    async def init_weights_update_group(
        self, master_address: str, master_port: int, group_name: str = "weight_update_group", backend: str = "gloo"
    ) -> dict[str, Any]:
        """Engine i joins as rank i + 1 of a group of len(engines) + 1; the trainer is rank 0 and must join
        concurrently (this call returns once every rank is in)."""
        world = len(self.urls) + 1
        ranks = {url: i + 1 for i, url in enumerate(self.urls)}
        return await self.each("init_weights_update_group", lambda c: c.init_weights_update_group(
            master_address, master_port, ranks[c.base_url], world, group_name, backend))

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], weight_version: str,
        group_name: str = "weight_update_group", **adapter: Any,
    ) -> dict[str, Any]:
        return await self.same("update_weights_from_distributed", lambda c: c.update_weights_from_distributed(
            names, dtypes, shapes, weight_version, group_name, **adapter))

    async def load_lora_adapter(self, lora_name: str, lora_path: str, update_in_flight: bool = False) -> dict[str, Any]:
        return await self.same(f"load_lora_adapter({lora_name!r})",
                               lambda c: c.load_lora_adapter(lora_name, lora_path, update_in_flight))

    async def replace_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Serve `lora_path` under `lora_name` on every engine, replacing the adapter loaded there: a verst engine
        replaces it in place, requests in flight going on with the new one; SGLang refuses a name it holds, so
        there the old one is unloaded first (an engine that does not hold it, new or restarted, answers 400 and
        the load follows)."""
        async def replace(client: EngineClient) -> Any:
            if await self._replaces_in_place(client):
                return await client.load_lora_adapter(lora_name, lora_path, update_in_flight=True)
            try:
                await client.unload_lora_adapter(lora_name)
            except EngineError as error:
                if error.status != 400:
                    raise
            return await client.load_lora_adapter(lora_name, lora_path)

        return await self.each(f"replace_lora_adapter({lora_name!r})", replace)

    async def _replaces_in_place(self, client: EngineClient) -> bool:
        if client.base_url not in self._in_place:
            info = await client.get_server_info()
            self._in_place[client.base_url] = info.get("engine") == "verst"  # the embedded engine says so
        return self._in_place[client.base_url]

    async def weight_versions(self) -> dict[str, str]:
        return await self.each("get_weight_version", lambda c: c.get_weight_version())

    async def health(self) -> dict[str, bool]:
        return await self.each("health", lambda c: c.health())


class _Captured(Exception):
    """The request a client call would make: (method, path, body, timeout)."""


class _RequestCapture(EngineClient):
    """A client whose calls make no request but say which they would make (`EngineFleet.same`)."""

    async def _post(self, path: str, body: dict[str, Any], timeout: float, headers: dict | None = None,
                    spread: bool = False) -> Any:
        raise _Captured("POST", path, body, timeout)

    async def _get(self, path: str) -> Any:
        raise _Captured("GET", path, None, self.timeouts.control)


class IdleMeter:
    """The engines' idle fraction between successive reads: 1 − Δbusy / Δuptime of each engine (from
    `/get_server_info`'s `busy_seconds` and `uptime_seconds`), averaged over the engines.

    Engines that do not report busy time (SGLang, vLLM), or do not answer (one being restarted), are left
    out; `read` returns None when none does.
    """

    def __init__(self, fleet: EngineFleet):
        self.fleet = fleet
        self._last: dict[str, tuple[float, float]] = {}  # url -> (busy_seconds, uptime_seconds)

    async def read(self) -> float | None:
        replies = await self.fleet.same_settled(lambda c: c.get_server_info())
        fractions = []
        for url, info in replies.items():
            if isinstance(info, BaseException) or "busy_seconds" not in info or "uptime_seconds" not in info:
                continue
            now = (float(info["busy_seconds"]), float(info["uptime_seconds"]))
            before, self._last[url] = self._last.get(url), now
            if before is not None and now[1] > before[1]:
                busy = (now[0] - before[0]) / (now[1] - before[1])
                fractions.append(min(1.0, max(0.0, 1.0 - busy)))
        return sum(fractions) / len(fractions) if fractions else None
