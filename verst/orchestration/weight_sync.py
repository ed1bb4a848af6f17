"""The driver's handle of the weight syncer that trainer rank 0 runs: what the RL loops call to push
weights (`due`, `version`, `sync(version)`, `close()`), with the weight check run from here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from verst.config.schema import SyncConfig
from verst.sync.syncer import SyncFailure, WeightSyncError, sync_due


class TrainerWeightSync:
    """Weights go from trainer rank 0 straight to the engines: a gloo/NCCL broadcast, shared memory or
    CUDA IPC on rank 0's host, or safetensors written there (see `TrainerActorGroup.open_weight_sync`).
    The lifecycle (pause → flush → push → version → continue, versions only up) runs there too.

    `checker` (`sync.check_weights`): a `LogprobChecker` run once, after the first sync, against `fleet`;
    it asks every trainer rank for logprobs, so it runs from the driver, not inside rank 0's push. Rank 0
    builds its syncer at the first push, so a trainer still starting is not waited for here.
    """

    def __init__(self, trainer: Any, cfg: SyncConfig, engine_urls: list[str], *, checker: Any = None,
                 fleet: Any = None, **transport_options: Any):
        if checker is not None and fleet is None:
            raise ValueError("TrainerWeightSync: a weight checker needs the engine fleet to probe")
        self.trainer, self.bucket_bytes, self.interval = trainer, cfg.bucket_bytes, cfg.interval
        self.checker, self.fleet = checker, fleet
        self._version: int | None = None
        self._opening = (cfg.model_copy(update={"check_weights": False}), list(engine_urls), transport_options)
        self._opened = False
        self._reconnect = False  # an engine was replaced: the next push sets its transport up again
        self.closed = False

    @property
    def version(self) -> int | None:
        """The engines' weight version after the last successful sync (None before the first one)."""
        return self._version

    def due(self, step: int) -> bool:
        return sync_due(step, self.interval)

    async def sync(self, version: int, *, first: bool = False, lora_path: str | None = None) -> dict[str, float]:
        """Push the trainer's current weights as `version`; returns the `sync/` metrics (and `sync/check_*`
        after the first sync when checking). `first`: a LoRA run's step-0 adapter, pushed before any
        rollout under the version the engines serve (the base's), which do not hold it yet; not checked.
        `lora_path` (multi-LoRA): the adapter this push carries, which the weight check's probes name."""
        if not self._opened:
            sync, urls, options = self._opening
            await asyncio.to_thread(self.trainer.open_weight_sync, sync, urls, **options)
            self._opened = True
        extra = {"first": True} if first else {}
        metrics = await asyncio.to_thread(self.trainer.sync_weights, version, self.bucket_bytes, self._reconnect,
                                          **extra)
        if isinstance(metrics, SyncFailure):  # the engines failed; the trainer is intact
            raise WeightSyncError(metrics.message)
        self._reconnect = False
        self._version = version
        if self.checker is not None and not first:
            checker, self.checker = self.checker, None  # once
            if lora_path is not None:
                checker.lora_path = lora_path
            metrics.update(await checker.check(self.fleet, version))
        return metrics

    def engine_replaced(self) -> None:
        """An engine was restarted at its URL: the next push reconnects the transport to every engine."""
        self._reconnect = True

    async def close_within(self, seconds: float) -> None:
        """After a failure: close if it can be done quickly (rank 0 may be dead or stuck; the orchestration's
        shutdown ends it regardless), errors ignored; a later `close()` then does nothing."""
        try:
            await asyncio.wait_for(self.close(), seconds)
        except Exception:
            pass

    async def close(self) -> None:
        """Close rank 0's syncer; once (a second call does nothing, even while the first still runs)."""
        if self._opened and not self.closed:
            self.closed = True
            await asyncio.to_thread(self.trainer.close_weight_sync)
