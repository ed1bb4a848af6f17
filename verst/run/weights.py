"""The weights an RL run pushes to its engines: the loops' sync step (trainer rank 0 pauses the engines,
pushes and continues them), made once more when an engine failed during it and was restarted; every
policy's weights at start-up and on resume; and what a restarted engine loads.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

from verst.config import VerstConfig
from verst.orchestration import WeightSyncHandle
from verst.orchestration.health import EngineSupervisor, RestartWeights
from verst.run.guard import Guard
from verst.run.lanes import Lane
from verst.sync.syncer import WeightSyncError
from verst.sync.transport import pushed_snapshot
from verst.trainer.backend import MERGED_LORA_DIR, TrainerRanks, export_at_step
from verst.trainer.rl_steps import use_adapter

log = logging.getLogger(__name__)


class WeightPush:
    """`syncer`: the handle of rank 0's syncer; `supervisor`: restarts failed engines (None: a run assembled
    without one); `weights_dir`: where a transport that keeps snapshots writes them (RUN/weights)."""

    def __init__(self, syncer: WeightSyncHandle, guard: Guard, *, transport: str, weights_dir: Path,
                 ranks: TrainerRanks, supervisor: EngineSupervisor | None = None):
        self.syncer, self.guard, self.transport, self.weights_dir = syncer, guard, transport, Path(weights_dir)
        self.ranks, self.supervisor = ranks, supervisor

    @property
    def version(self) -> int:
        """The version the engines serve (0 before the first push: the source model)."""
        return self.syncer.version or 0

    def due(self, version: int) -> bool:
        """Whether the weights of trainer step `version` are pushed (`sync.interval`)."""
        return self.syncer.due(version)

    async def push(self, version: int, lane: Lane | None = None) -> dict[str, float]:
        """Push the trainer's weights as `version` (pause → push → continue), within `fault.sync_timeout_s`;
        multi-LoRA: `lane`'s adapter, the one its step trained, under its name."""
        adapter = lane.adapter if lane is not None else None
        return await self.guard(f"weight sync to version {version}", "sync_timeout_s", self._push(version, adapter))

    async def _push(self, version: int, adapter: str | None) -> dict[str, float]:
        named = {"lora_path": adapter} if adapter is not None else {}  # multi-LoRA: the adapter the push carries
        if self.supervisor is None:
            return await self.syncer.sync(version, **named)
        # Again after each failure that an engine restart followed: the push fails on an engine that died or
        # hung during it, which is then replaced; a failure no restart follows (an engine that refuses the
        # weights) is raised. Each engine can fail a push once per restart, so the attempts are bounded.
        restarted = self.supervisor.restarts
        while True:
            await self.supervisor.check_now()  # a dead engine is restarted before the push reaches it
            async with self.supervisor.lock:  # no push while an engine is being replaced
                try:
                    metrics = await self.syncer.sync(version, **named)
                    await self.supervisor.admit_synced(version)  # engines restarted ahead of the others
                    return metrics
                except WeightSyncError as error:
                    if not self.supervisor.restarts_engines:
                        raise
                    failure = error
            await self.supervisor.check_now()  # the engine that failed it is found and restarted
            if self.supervisor.restarts == restarted:
                raise failure
            restarted = self.supervisor.restarts
            log.warning("%s; pushing again now that failed engines are restarted", failure)

    async def push_adapters(self, version: int, lanes: list[Lane]) -> dict[str, float]:
        """Multi-LoRA: every adapter, each under its name, as `version` (start-up: 0, the engines' base
        version; resume: the checkpoint's), before any rollout. The pushes after the first of a version carry
        the version the engines already serve (`first`), as does a step-0 push; none is weight-checked."""
        metrics: dict[str, float] = {}
        for index, lane in enumerate(lanes):
            await asyncio.to_thread(self.ranks.apply, use_adapter, lane.adapter)
            pushed = await self.syncer.sync(version, first=index > 0 or version == 0, lora_path=lane.adapter)
            metrics |= lane.namespaced(pushed)
        return metrics

    async def push_first(self, version: int = 0) -> dict[str, float]:
        """A LoRA run's step-0 adapter before any rollout (every request names it), or a resumed run's weights."""
        return await self.syncer.sync(version, first=version == 0)

    def model_snapshot(self, version: int, *, lora: bool) -> Path | None:
        """The push's own Hugging Face snapshot of `version`, where the transport keeps one and it is a full
        model (with LoRA it is an adapter); None otherwise."""
        path = pushed_snapshot(self.transport, self.weights_dir, version)
        return path if path is not None and not lora and path.is_dir() else None

    async def close(self) -> None:
        await self.syncer.close()

    async def close_within(self, seconds: float) -> None:
        await self.syncer.close_within(seconds)


class RestartSource:
    """What a restarted engine loads (`EngineSupervisor`'s `restart_weights`). Before the first push: the
    source model, version 0. A transport that keeps snapshots: its snapshot of the version the engines serve.
    The others keep no copy, so the trainer exports its current weights on demand into RUN/weights/restart
    (an HF checkpoint), with the number of steps they have taken as their version, which may be ahead of the
    engines' until the next push (with LoRA: the merged model of that export). With LoRA's adapter sync, once
    the step-0 adapter is pushed: the base model, then the adapter (the snapshot, or the trainer's export)."""

    def __init__(self, cfg: VerstConfig, syncer: WeightSyncHandle, ranks: TrainerRanks, weights_dir: Path):
        self.cfg, self.syncer, self.ranks, self.weights_dir = cfg, syncer, ranks, Path(weights_dir)

    async def __call__(self) -> RestartWeights:
        cfg, pushed = self.cfg, self.syncer.version
        version = pushed or 0
        kept = pushed_snapshot(cfg.sync.transport, self.weights_dir, version)
        if cfg.lora.adapters and pushed is not None:  # multi-LoRA: every adapter, as the trainer holds it
            steps, directory = await self._export()
            names = [adapter.name for adapter in cfg.lora.adapters]
            return RestartWeights(cfg.model.path, steps, adapters=tuple((n, str(directory / n)) for n in names))
        if cfg.lora.served_adapter and pushed is not None:
            if kept is not None:
                return RestartWeights(cfg.model.path, version, (cfg.lora.served_adapter, str(kept)))
            steps, directory = await self._export()
            return RestartWeights(cfg.model.path, steps, (cfg.lora.served_adapter, str(directory)))
        if not version:
            return RestartWeights(cfg.model.path, 0)
        if kept is not None:
            return RestartWeights(str(kept), version)
        if cfg.lora.enabled:  # a LoRA export is an adapter: the engine loads the merged model beside it
            steps, directory = await self._export(merge_lora=True)
            return RestartWeights(str(directory / MERGED_LORA_DIR), steps)
        steps, directory = await self._export()
        return RestartWeights(str(directory), steps)

    async def _export(self, merge_lora: bool = False) -> tuple[int, Path]:
        """The trainer's current weights in RUN/weights/restart, and the steps they have taken."""
        directory = self.weights_dir / "restart"
        shutil.rmtree(directory, ignore_errors=True)
        steps = await asyncio.to_thread(self.ranks.apply, export_at_step, str(directory), merge_lora)
        return int(steps[0]), directory
