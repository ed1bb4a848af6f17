"""The simulated trainer: a `TrainBackend` whose weights are placeholders of the declared model's size, and the
trainer ranks of a simulated run. A train step takes what the latency model says (6 · N · tokens over the
trainer's GPUs at its MFU) and records the groups it trained; the weight push is rank 0's real one: the
syncer (pause, bucketed loads, versions, continue) over every simulated engine, in a process of its own as on a
real rank (`syncer_process`), with a transport that sends each bucket's names, dtypes and shapes, from which the
engines charge the transfer time.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from verst.config import SyncConfig, VerstConfig, batch_plan
from verst.monitor.checkpoint_dirs import TRAINER_COMPLETE
from verst.sim.accounting import LEDGER
from verst.sim.clock import SimClock
from verst.sim.latency import TrainerCosts
from verst.sim.syncer_process import SyncerProcess
from verst.sync.syncer import SyncFailure
from verst.trainer.rl_steps import train_adapter_step, train_rollout_step
from verst.types import Group, WeightBucket

log = logging.getLogger(__name__)
WEIGHT_TENSORS = 256  # tensors the placeholder weights are split into
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


class DeclaredTensor:
    """A weight of a declared shape and dtype with no data: what the push's accounting and the transport read
    (`numel`, `element_size`, `dtype`, `shape`)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: str):
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"DeclaredTensor: dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        self.shape, self.dtype = shape, dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def detach(self) -> DeclaredTensor:
        return self


class SimBackend:
    """`TrainBackend` of the simulation: its weights are `total_params` placeholders of `bytes_per_param`; its
    checkpoints and exports are a small JSON file with the step."""

    sync_adapter = None

    def __init__(self, total_params: float, bytes_per_param: float):
        self.step = 0
        dtype = {1.0: "float8_e4m3fn", 2.0: "bfloat16", 4.0: "float32"}.get(bytes_per_param)
        if dtype is None:
            raise ValueError(f"sim.bytes_per_param = {bytes_per_param} is not 1, 2 or 4 (fp8, bf16, fp32)")
        per_tensor = max(1, int(total_params // WEIGHT_TENSORS))
        self.weights = [(f"model.layers.{i}.weight", DeclaredTensor((per_tensor,), dtype)) for i in range(WEIGHT_TENSORS)]

    def named_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        yield list(self.weights)  # the transport regroups them to its own bucket size

    def synced_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        return self.named_weights(bucket_bytes)

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "sim_trainer.json").write_text(json.dumps({"step": self.step}))
        (Path(directory) / TRAINER_COMPLETE).write_text(f"step {self.step}\n")  # a synchronous save is whole

    def load(self, directory: str | Path) -> None:
        self.step = int(json.loads((Path(directory) / "sim_trainer.json").read_text())["step"])

    def export_hf(self, directory: str | Path, *, merge_lora: bool = False) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps({"simulated": True, "step": self.step}))


class SimTrainerRanks:
    """The trainer ranks of a simulated run, in this process: what `TrainerGroup`, `WeightPush`, the checkpointer
    and `TrainerWeightSync` call (`apply`, `infos`, `open_weight_sync`, `sync_weights`, `close_weight_sync`)."""

    infos: list[dict[str, Any]] = []
    ready_infos: list[dict[str, Any]] = []

    def __init__(self, backend: SimBackend, costs: TrainerCosts, clock: SimClock, plugins: list[str]):
        """`plugins`: the run's, imported by the weight-sync process (the simulation's transport is one)."""
        self.backend, self.costs, self.clock, self.plugins = backend, costs, clock, plugins
        self.weight_sync: SyncerProcess | None = None
        self.step_seconds: list[float] = []  # the modelled seconds of each step (simulated)
        self._kept: list[Group] = []
        self._lock = threading.Lock()  # one collective call at a time, as on real ranks
        self._closed = False

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        with self._lock:
            if fn is train_adapter_step:
                raise ValueError("the simulated trainer trains one policy (multi-LoRA is not simulated)")
            if fn is train_rollout_step:
                return [self._train(*args)]
            return [fn(self.backend, *args, **kwargs)]

    def _train(self, batch: list[Group] | None, first: int, cfg: VerstConfig, version: int | None = None
               ) -> dict[str, float]:
        """One optimizer step on groups [first, first + groups per step) of the rollout batch (kept from its
        first step), as `train_rollout_step` does on a real rank; it takes the latency model's time (no loss:
        `version` is not read)."""
        per_step = batch_plan(cfg).groups_per_train_step
        if batch is not None:
            self._kept = list(batch)
        groups = self._kept[first:first + per_step]
        tokens = sum(len(s.tokens) for g in groups for s in g)
        seconds = self.costs.step_s(tokens)
        if first == 0 and len(self._kept) > per_step:  # the old policy's logprobs of the whole batch, once
            seconds += self.costs.forward_s(sum(len(s.tokens) for g in self._kept for s in g))
        LEDGER.train(groups)
        time.sleep(self.clock.wall(seconds))
        self.backend.step += 1
        self.step_seconds.append(seconds)
        return {"time/sim_train_s": seconds, "perf/train_tokens_per_s": tokens / seconds if seconds else 0.0}

    # ---- rank 0's weight sync -------------------------------------------------------------------
    def open_weight_sync(self, sync: SyncConfig, engine_urls: list[str], **transport_options: Any) -> None:
        self.weight_sync = SyncerProcess(sync, engine_urls, transport_options, self.plugins)

    def sync_weights(self, version: int, bucket_bytes: int, reconnect: bool = False,
                     first: bool = False) -> dict[str, float] | SyncFailure:
        if self.weight_sync is None:
            raise RuntimeError("sync_weights before open_weight_sync")
        return self.weight_sync.sync(list(self.backend.synced_weights(bucket_bytes)), version, first, reconnect)

    def close_weight_sync(self) -> None:
        if self.weight_sync is not None:
            weight_sync, self.weight_sync = self.weight_sync, None
            weight_sync.close()

    def shutdown(self) -> None:
        self._closed = True
        self.close_weight_sync()
