"""The weight-sync lifecycle, in one place: pause → flush cache → push (a transport) → set version →
continue; versions only go up, engines are always continued, and an optional check follows the first sync.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

from verst.inference_client.fleet import EngineFleet
from verst.sync.buckets import PrefetchedSource
from verst.sync.transport import AdapterSpec, WeightTransport
from verst.types import WeightBucket

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "retract", "in_place")


def sync_due(step: int, interval: int) -> bool:
    """Whether the weights of train step `step` (1-based count of steps taken) are pushed (`sync.interval`)."""
    return step % interval == 0


class VersionError(ValueError):
    """A sync would not move the engines' weight version forward."""


class WeightSyncError(RuntimeError):
    """A sync failed; the message says what state the engines were left in (continued or still paused)."""


@dataclasses.dataclass(frozen=True)
class SyncFailure:
    """A failed sync reported as a value (by trainer rank 0, which must live on: the engines failed, not
    it); the driver raises it again as `WeightSyncError`."""

    message: str


class Checker(Protocol):
    async def check(self, fleet: EngineFleet, version: int) -> dict[str, float]: ...


class WeightSyncer:
    """Pushes trainer weights to every engine of `fleet` through `transport`.

    `pause_mode` is how in-flight requests wait (SGLang's modes). The cache is flushed after pausing,
    except under `in_place`, whose point is to keep in-flight KV (SGLang also refuses to flush while
    requests are in flight); the weight loads themselves still drop the prefix cache. A transport with
    `versioned_loads` flushes with its loads and sets the version with its last one (one request each). `checker` runs
    once, after the first successful sync. `interval` is how many train steps apart syncs are (`due`).
    """

    def __init__(
        self, fleet: EngineFleet, transport: WeightTransport, *, pause_mode: str = "retract", interval: int = 1,
        checker: Checker | None = None, label: str | None = None,
    ):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"sync.pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if interval < 1:
            raise ValueError(f"sync.interval must be >= 1, got {interval}")
        self.fleet, self.transport, self.pause_mode = fleet, transport, pause_mode
        self.interval, self.checker = interval, checker
        self.label = label or type(transport).__name__  # its name in messages (`sync.transport`)
        self._version: int | None = None  # the version every engine serves after the last successful sync
        self._checked = False

    @property
    def version(self) -> int | None:
        """The engines' weight version after the last successful sync (None before the first one)."""
        return self._version

    def due(self, step: int) -> bool:
        return sync_due(step, self.interval)

    async def current_version(self) -> int:
        """The version the engines serve: remembered after a sync, else read from every engine (the highest)."""
        if self._version is None:
            found = await self.fleet.weight_versions()
            parsed = {}
            for url, value in found.items():
                try:
                    parsed[url] = int(value)
                except ValueError:
                    raise VersionError(f"{url} reports weight_version {value!r}, not an integer; weight sync "
                                       "versions are integer training steps") from None
            self._version = max(parsed.values())
        return self._version

    async def sync(self, buckets: Iterable[WeightBucket], version: int, *, first: bool = False) -> dict[str, float]:
        """Push `buckets` as `version` (must exceed the engines' version; with `first` it may equal it: a
        LoRA run's step-0 adapter, which engines serving the base as that version do not hold yet, and which
        the check does not count as the first sync); returns `sync/` metrics.

        On any failure every engine is continued and `WeightSyncError` is raised; the engines then still
        report the previous version but may hold some tensors of the new one (sync again before use).
        """
        previous = await self.current_version()
        if version < previous or (version == previous and not first):
            raise VersionError(f"weight version must go up: asked to sync version {version} but the engines "
                               f"serve version {previous}")
        start = time.perf_counter()
        # The first bucket is read before the pause, so the engines wait only for the push itself.
        source = await PrefetchedSource.read_first(buckets)
        paused = time.perf_counter()
        # a transport with versioned loads flushes with its loads and sets the version with the last one
        folded = self.transport.versioned_loads
        try:
            await self.fleet.pause(self.pause_mode)
            if self.pause_mode != "in_place" and not folded:
                await self.fleet.flush_cache()
            metrics = await self.transport.push(source, version)
            if not folded:
                await self.fleet.each(f"update_weight_version({version})",
                                      lambda c: c.update_weight_version(str(version)))
        except BaseException as exc:
            source.close()  # a transport that failed before reading it leaves the trainer's stream open
            await self._continue_after_failure(exc, version, previous)
            raise  # only reached for cancellation and interrupts, which are re-raised unwrapped
        try:
            await self.fleet.continue_generation()
        except Exception as exc:
            raise WeightSyncError(f"weights of version {version} are loaded on every engine, but "
                                  f"continue_generation failed, so these engines may still be PAUSED: {exc}") from exc
        self._version = version
        metrics.update({
            "sync/seconds": time.perf_counter() - start, "sync/paused_seconds": time.perf_counter() - paused,
            "sync/version": float(version),
        })
        if self.checker is not None and not self._checked and not first:
            metrics.update(await self.checker.check(self.fleet, version))
            self._checked = True
        return metrics

    async def _continue_after_failure(self, exc: BaseException, version: int, previous: int) -> None:
        """Continue every engine, then raise a `WeightSyncError` saying what failed and what state is left."""
        failed = f"weight sync to version {version} ({self.label}) failed: {type(exc).__name__}: {exc}"
        try:
            await self.fleet.continue_generation()
        except Exception as cont:
            if not isinstance(exc, Exception):
                log.error("%s; continue_generation then failed too: %s", failed, cont)
                return
            raise WeightSyncError(f"{failed}. Then continue_generation failed too, so these engines may still be "
                                  f"PAUSED: {cont}") from exc
        if isinstance(exc, Exception):
            reported = f"they still report version {previous}"
            if self.transport.versioned_loads:
                reported += f" (or {version}, where their load of the last bucket went through)"
            raise WeightSyncError(
                f"{failed}. Every engine was continued; {reported} but may hold some tensors of version "
                f"{version}: sync again before trusting their weights.") from exc

    def use_adapter(self, adapter: AdapterSpec | None) -> None:
        """LoRA's adapter sync: the next pushes carry `adapter` (see `WeightTransport.use_adapter`)."""
        self.transport.use_adapter(adapter)

    async def reconnect(self) -> None:
        """An engine was replaced by a new server at the same URL: drop what the transport holds (a
        distributed group with the old server in it); the next push sets it up again with every engine."""
        await self.transport.close()

    async def close(self) -> None:
        await self.transport.close()

    def describe(self) -> dict[str, Any]:
        """For the run config / logs: the transport by name (metrics are numbers; the run's config.yaml and summary.json name the transport)."""
        return {"transport": self.label, "pause_mode": self.pause_mode, "interval": self.interval,
                "check_weights": self.checker is not None}
