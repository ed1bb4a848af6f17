"""The TrainBackend contract: the handful of methods every training backend (FSDP2 is the one built)
offers to the schedules, the driver-side handle of N ranks and weight transports.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from verst.types import Sample, WeightBucket

if TYPE_CHECKING:  # this module is imported by torch-free driver code (handles, transports' types)
    import torch

    from verst.trainer.items import TrainItem
    from verst.trainer.losses import LossFn, Normalizer

Batch = Sequence["TrainItem | Sample"]
MERGED_LORA_DIR = "merged"  # a LoRA export's merged model, inside the adapter directory


class RankError(RuntimeError):
    """A rank failed; the message carries the rank and its traceback (or exit code)."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"trainer rank {rank} failed:\n{detail}")
        self.rank = rank


@runtime_checkable
class TrainBackend(Protocol):
    """Every method is collective: in a multi-rank group, every rank calls it with the same global
    batch (each rank picks its token-balanced share) and gets the same result.
    """

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load`)."""
        ...

    def logprobs(
        self, batch: Batch, *, reference: bool = False, with_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Forward-only log π(response token) per item, `[response_length]` each, in batch order.

        `reference=True` uses the frozen reference model. With `with_entropy`, returns
        `(logprobs, entropies)`, both lists of `[response_length]` tensors.
        """
        ...

    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, normalizer: Normalizer = ..., with_entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer step over the global batch; returns `train/loss`, `train/grad_norm`,
        `train/lr`, `perf/train_tokens_per_s` and the loss fn's metrics under `train/`."""
        ...

    def values(self, batch: Batch) -> list[torch.Tensor]:
        """PPO's critic: forward-only V(s_t) per item, `[response_length]` each, in batch order (a backend
        built without a critic raises)."""
        ...

    def train_critic(self, batch: Batch, loss_fn: LossFn, *, normalizer: Normalizer = ...) -> dict[str, float]:
        """One optimizer step of PPO's critic; `loss_fn` reads `outputs.values`. Returns the loss fn's
        metrics and `train/value_grad_norm`, `train/value_lr`."""
        ...

    def named_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Full, HF-named weights in buckets of about `bucket_bytes` (a bigger tensor goes alone)."""
        ...

    def synced_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """What weight sync pushes: `named_weights`, or with LoRA's adapter sync the adapter's tensors
        (PEFT's names), whose served name and adapter_config `sync_adapter` gives."""
        ...

    @property
    def sync_adapter(self) -> tuple[str, dict] | None: ...

    def save(self, directory: str | Path) -> None:
        """Model, optimizer, lr schedule, RNG state and step (and PPO's critic with its optimizer and lr
        schedule): everything `load` needs to resume."""
        ...

    def load(self, directory: str | Path) -> None: ...

    def export_hf(self, directory: str | Path, *, merge_lora: bool = False) -> None:
        """A checkpoint `transformers` loads, with the source model's tokenizer files copied. With LoRA: the
        PEFT adapter directory, and with `merge_lora` also the merged model in its `MERGED_LORA_DIR`."""
        ...


class TrainerRanks(Protocol):
    """The driver's handle of the trainer ranks as an RL run uses it: functions that run next to the model
    (the Ray rank group, `verst.orchestration.TrainerActorGroup`, or `InProcessRank`)."""

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`fn(backend, *args, **kwargs)` on every rank (collective); the results, by rank."""
        ...

    @property
    def infos(self) -> list[dict[str, Any]]:
        """Per rank: at least `ready_at` (wall clock, backend built); empty where there is no start-up."""
        ...


class InProcessRank:
    """A backend in this process as `TrainerRanks`: one rank, already built."""

    infos: list[dict[str, Any]] = []

    def __init__(self, backend: TrainBackend):
        self.backend = backend

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return [fn(self.backend, *args, **kwargs)]


class CollectiveCalls:
    """The TrainBackend methods of a driver-side handle of N ranks (the Ray rank actor
    group, `verst.orchestration.TrainerActorGroup`): each runs on every rank through `self.call(method, ...)` and returns rank 0's result."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        raise NotImplementedError

    @property
    def step(self) -> int:
        return self.call("step")[0]

    def logprobs(
        self, batch: Batch, *, reference: bool = False, with_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.call("logprobs", list(batch), reference=reference, with_entropy=with_entropy)[0]

    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, normalizer: Normalizer | None = None, with_entropy: bool = False,
    ) -> dict[str, float]:
        """`normalizer` None: the backend's default (policy tokens)."""
        options = {"with_entropy": with_entropy} | ({"normalizer": normalizer} if normalizer is not None else {})
        return self.call("train_step", list(batch), loss_fn, **options)[0]

    def values(self, batch: Batch) -> list[torch.Tensor]:
        return self.call("values", list(batch))[0]

    def train_critic(self, batch: Batch, loss_fn: LossFn, *, normalizer: Normalizer | None = None
                     ) -> dict[str, float]:
        options = {"normalizer": normalizer} if normalizer is not None else {}
        return self.call("train_critic", list(batch), loss_fn, **options)[0]

    def save(self, directory: str | Path) -> None:
        self.call("save", str(directory))

    def load(self, directory: str | Path) -> None:
        self.call("load", str(directory))

    def export_hf(self, directory: str | Path, *, merge_lora: bool = False) -> None:
        self.call("export_hf", str(directory), merge_lora=merge_lora)


# Rank-side checkpoint steps for `TrainerRanks.apply` (module functions: Ray pickles them by reference).
def save_backend(backend: TrainBackend, directory: str, background: bool = False) -> None:
    """`backend.save`; with `background`, in a thread where the backend offers it (FSDP2): the caller then
    waits for every rank's `done_rank<R>` file and writes COMPLETE."""
    if background and "background" in inspect.signature(backend.save).parameters:
        backend.save(directory, background=True)
    else:
        backend.save(directory)


def load_backend(backend: TrainBackend, directory: str) -> int:
    backend.load(directory)
    return backend.step


def export_backend(backend: TrainBackend, directory: str, merge_lora: bool = False) -> None:
    backend.export_hf(directory, merge_lora=merge_lora)


def export_at_step(backend: TrainBackend, directory: str, merge_lora: bool = False) -> int:
    """`backend.export_hf`, returning the number of optimizer steps the exported weights have taken."""
    backend.export_hf(directory, merge_lora=merge_lora)
    return backend.step
