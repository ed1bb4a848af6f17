"""What an RL run asks of the driver-side handles of its engines, rollout manager and weight syncer:
the few methods the loops call, as protocols (the Ray handles of this package satisfy them; fakes may)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class TrainBatchRef:
    """The driver's handle of one batch of groups to train on: the groups where they are (in an RL run an
    object reference into Ray's object store, which the trainer ranks resolve; or the groups themselves,
    in one process) and how many there are."""

    groups: Any  # ray.ObjectRef of list[Group], or list[Group]
    num_groups: int


class EngineMemory(Protocol):
    """The engines, as a colocated run uses them around each train step (`EngineActorGroup`)."""

    urls: list[str]

    def release_memory(self, indices: list[int] | None = None) -> dict[int, Any]:
        """The engines of `indices` (default all) give their device memory back while the trainer steps; by
        engine, True or the error of one that failed."""
        ...

    def resume_memory(self, indices: list[int] | None = None) -> dict[int, Any]:
        """Undo `release_memory`, by engine as it."""
        ...


class RolloutSource(Protocol):
    """The rollout manager, as the loops use it (`RolloutManagerHandle`): train batches as references to
    groups that stay on the rollout side, with their metrics. Blocking calls."""

    router_url: str | None

    def generate_train_batch(self, rollout_id: int, weight_version: int) -> tuple[TrainBatchRef, dict[str, float]]:
        """Sync and one-step-off: one rollout step."""
        ...

    def start_async(self) -> None:
        """Fully async: start the background worker."""
        ...

    def take_batch(self, n: int, version: int, timeout: float | None = None,
                   ) -> tuple[TrainBatchRef, dict[str, float] | None]:
        """Fully async: fresh groups into the train batch being assembled, waiting at most `timeout`; the batch
        and its metrics once it holds n, else a reference counting the groups it holds and None."""
        ...

    def progress(self) -> str:
        """Fully async: what the worker made of its groups so far (finished, dropped by reason, generating)."""
        ...

    def stop_async(self) -> int:
        """Fully async: stop the worker; how many unfinished groups it handed back."""
        ...

    def evaluate(self, version: int) -> dict[str, float]:
        """An image run's held-out score through the engines, which must serve `version` (its reward lives on the
        rollout side)."""
        ...

    def save_state(self, path: str) -> dict[str, int]:
        """Checkpoint: write the rollout side's state (source, buffer, worker) to `path`; the counts saved."""
        ...

    def load_state(self, path: str) -> None:
        """Resume: restore what `save_state` wrote, before generation starts."""
        ...


class WeightSyncHandle(Protocol):
    """The weight syncer, as the loops use it (`TrainerWeightSync`)."""

    @property
    def version(self) -> int | None:
        """The engines' weight version after the last push (None before the first)."""
        ...

    def due(self, step: int) -> bool:
        """Whether the weights of trainer step `step` are pushed (`sync.interval`)."""
        ...

    async def sync(self, version: int, **options: Any) -> dict[str, float]:
        """Push the trainer's weights as `version`; the `sync/` metrics. Multi-LoRA passes `lora_path`, the
        adapter the push carries, and at start-up or resume `first` (`TrainerWeightSync.sync`)."""
        ...

    async def close(self) -> None:
        """Close rank 0's syncer (its transport's group or files); once."""
        ...

    async def close_within(self, seconds: float) -> None:
        """After a failure: close if it can be done within `seconds`, errors ignored."""
        ...
