"""Rank 0's side of the weight sync: its syncer on an event loop of its own, and the bucket source that
finishes its gathers when a push stops early."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

from verst.config.schema import SyncConfig
from verst.types import WeightBucket


class SyncerLoop:
    """Rank 0's `WeightSyncer` on an event loop thread of its own: its HTTP clients and transport (a
    process group, shared-memory files) live across syncs, while the actor's calls stay synchronous."""

    def __init__(self, sync: SyncConfig, engine_urls: list[str], options: dict[str, Any]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="verst-weight-sync", daemon=True)
        self.thread.start()
        try:
            self.fleet, self.syncer = self.run(self._open(sync, engine_urls, options))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _open(sync: SyncConfig, engine_urls: list[str], options: dict[str, Any]) -> tuple[Any, Any]:
        from verst.inference_client.client import Timeouts
        from verst.inference_client.fleet import EngineFleet
        from verst.sync.factory import build_syncer

        options = dict(options)
        control = options.pop("control_timeout_s", None)  # fault.engine_call_timeout_s
        timeouts = Timeouts(control=control) if control else None
        fleet = EngineFleet(engine_urls, timeouts=timeouts)  # its clients belong to this loop
        return fleet, build_syncer(sync, fleet, **options)

    def sync(self, buckets: Iterator[WeightBucket], version: int, first: bool = False) -> dict[str, float]:
        return self.run(self.syncer.sync(buckets, version, first=first))

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        try:
            self.run(self.syncer.close())
            self.run(self.fleet.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        if not self.thread.is_alive():
            self.loop.close()


class DrainOnClose:
    """A bucket source whose `close()` reads what is left instead of abandoning it: every rank takes part
    in every gather of `named_weights`, so a push that stops early must still finish them on rank 0."""

    def __init__(self, buckets: Iterator[WeightBucket]):
        self._buckets = buckets

    def __iter__(self) -> DrainOnClose:
        return self

    def __next__(self) -> WeightBucket:
        return next(self._buckets)

    def close(self) -> None:
        for _ in self._buckets:
            pass
