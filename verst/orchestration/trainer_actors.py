"""Trainer ranks as Ray actors, each hosting one backend rank, and `TrainerActorGroup`, the driver's
handle that runs every backend method on all ranks: the one launcher of ranks (RL, and SFT over N > 1).

Rank 0 also runs the weight syncer (pause → flush → push → version → continue): it holds the full
weights after each gather, so buckets go from there to the engines without a trip through the driver,
which therefore needs no torch (the driver's imports stay off a 2-core machine's start-up).

Failure model: a rank that raises or dies makes the driver raise `RankError` naming that rank; a
call that makes no progress within its timeout raises `TimeoutError`. Either way every rank actor is
killed (its collectives are in an unknown state), so the driver never hangs on a broken group.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from verst.config.schema import SyncConfig
from verst.inference_client.ports import free_port
from verst.monitor.heap import settle_heap
from verst.monitor.stacks import arm_stack_dump
from verst.orchestration.placement import Placement, current_bundle
from verst.orchestration.rank_sync import DrainOnClose, SyncerLoop
from verst.sync.syncer import SyncFailure, WeightSyncError
from verst.trainer.backend import CollectiveCalls, RankError, TrainBackend
from verst.types import WeightBucket
from verst.types.cores import CoreShare, take_share

# Buckets rank 0 may have produced ahead of the driver: bounds the object store's share of weights.
STREAM_AHEAD_BUCKETS = 2


class TrainerRank:
    """The body of one trainer rank actor. Methods are called by `TrainerActorGroup` only."""

    def __init__(self, rank: int, world_size: int, device: str, log_dir: str | None = None):
        from verst.orchestration.tensor_wire import register_tensor_serializer  # imports torch: ranks only

        # A hang report can read this rank's stacks; its output goes to RUN/logs/trainer-<rank>.log.
        arm_stack_dump(Path(log_dir) / f"trainer-{rank}.log" if log_dir else None)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend: TrainBackend | None = None
        self.weight_sync: SyncerLoop | None = None  # rank 0, after open_weight_sync
        self.ready_at: float | None = None
        register_tensor_serializer()  # logprobs and weight buckets back to the driver
        # Ray shows a GPU actor only its own device (CUDA_VISIBLE_DEVICES), which is then cuda:0.
        os.environ["LOCAL_RANK"] = "0"

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address the process group's store will listen on (this node, a free port)."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def setup(self, rendezvous: tuple[str, int], factory: Callable[[], TrainBackend], timeout_s: float,
              share: CoreShare | None = None) -> dict:
        """`rendezvous`: rank 0's (address, port), which Ray hands over once rank 0 has answered. `share`: on
        CPU, the cores and threads this rank computes on (None: one thread, unpinned)."""
        import torch

        from verst.trainer.distributed import init_process_group, resolve_device

        device = resolve_device(self.device)
        if device.type == "cpu":
            if share is not None:
                take_share(share)
            else:
                torch.set_num_threads(1)
        _quiet_transformers()
        # Rank 0 serves the rendezvous store itself (the torchrun arrangement); the others connect.
        init_process_group(self.rank, self.world_size, *rendezvous, device, timeout_s)
        self.backend = factory()
        settle_heap(owned=True)  # the model, optimizer and imports never walked again by the collector
        self.ready_at = time.time()  # wall clock: when the backend was built (the driver's start-up metric)
        return self.info()

    def set_cores(self, share: CoreShare) -> None:
        """Compute on `share`'s cores with its threads from now on (between steps: the run's core budget)."""
        take_share(share)

    def info(self) -> dict[str, Any]:
        placement_group, bundle = current_bundle()
        return {"rank": self.rank, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "placement_group": placement_group, "bundle": bundle, "ready_at": self.ready_at}

    def call(self, method: str, payload: tuple[tuple, dict]) -> Any:
        args, kwargs = payload
        attribute = getattr(self.backend, method)
        return attribute(*args, **kwargs) if callable(attribute) else attribute

    def apply(self, fn: Callable[..., Any], payload: tuple[tuple, dict]) -> Any:
        """`fn(backend, *args, **kwargs)`; an object reference among `args` is resolved here (a rollout
        batch goes from the object store straight to the ranks)."""
        args, kwargs = payload
        args = tuple(ray.get(arg) if isinstance(arg, ray.ObjectRef) else arg for arg in args)
        return fn(self.backend, *args, **kwargs)

    def stream_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Rank 0: yield each bucket (a Ray streaming generator: one object per bucket). Copies: the wire form
        views a tensor's storage through NumPy, which makes it non-resizable, and a full weight may share
        the storage FSDP frees (by resizing it) at the next reshard."""
        for bucket in self.backend.named_weights(bucket_bytes):
            yield [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in bucket]

    def drain_weights(self, bucket_bytes: int) -> None:
        """Ranks > 0: take part in the gathers of `synced_weights`, keeping nothing."""
        for _ in self._synced_weights(bucket_bytes):
            pass

    def _synced_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """What weight sync pushes (`TrainBackend.synced_weights`; a backend without it: `named_weights`)."""
        synced = getattr(self.backend, "synced_weights", None)
        return synced(bucket_bytes) if synced is not None else self.backend.named_weights(bucket_bytes)

    # ---- weight sync (rank 0 pushes; the others take part in its gathers) ----------------------------
    def open_weight_sync(self, sync: SyncConfig, engine_urls: list[str], transport_options: dict[str, Any]) -> None:
        """Rank 0: build the syncer of `sync` over clients of `engine_urls` (see `verst.sync.build_syncer`);
        a distributed transport's group is rooted at this node's address. With LoRA's adapter sync every push
        is the backend's adapter (`sync_adapter`: its served name and config)."""
        options = {"master_address": ray.util.get_node_ip_address(), **transport_options}
        adapter = getattr(self.backend, "sync_adapter", None)
        if adapter is not None:
            from verst.sync.transport import AdapterSpec

            options["adapter"] = AdapterSpec(*adapter)
        self.weight_sync = SyncerLoop(sync, engine_urls, options)

    def sync_weights(self, version: int, bucket_bytes: int, reconnect: bool = False,
                     first: bool = False) -> dict[str, float]:
        """Rank 0: push the backend's weights as `version` and return the `sync/` metrics; the other ranks
        only take part in the gathers. A push that stops early still finishes them (`DrainOnClose`).
        `first`: a LoRA run's step-0 adapter, pushed under the version the engines serve (`WeightSyncer.sync`)."""
        if self.rank:
            self.drain_weights(bucket_bytes)
            return {}
        if self.weight_sync is None:
            raise RuntimeError("sync_weights before open_weight_sync")
        adapter = getattr(self.backend, "sync_adapter", None)
        if adapter is not None:  # multi-LoRA: each push is the adapter trained last, under its own name
            from verst.sync.transport import AdapterSpec

            self.weight_sync.syncer.use_adapter(AdapterSpec(*adapter))
        buckets = DrainOnClose(self._synced_weights(bucket_bytes))
        try:
            if reconnect:
                self.weight_sync.run(self.weight_sync.syncer.reconnect())
            return self.weight_sync.sync(buckets, version, first)
        except WeightSyncError as error:  # an engine failed: this rank, and the trainer group, live on
            return SyncFailure(str(error))
        finally:
            buckets.close()  # a no-op after a complete push

    def close_weight_sync(self) -> None:
        if self.weight_sync is not None:
            weight_sync, self.weight_sync = self.weight_sync, None
            weight_sync.close()


_RemoteTrainerRank = ray.remote(max_restarts=0, max_task_retries=0)(TrainerRank)


class TrainerActorGroup(CollectiveCalls):
    """N trainer rank actors placed by `placement`; use as a context manager.

    `factory()` builds the backend inside each rank once the process group is up; it must be
    picklable (e.g. `functools.partial(FSDP2Backend, model_cfg, trainer_cfg, device=...)`) and agree
    with `device`. Every method runs on all ranks; results come from rank 0 (they are identical).
    With `wait=False` the ranks start in the background: the first call (or `wait_ready()`) waits for them.
    `shares`: on CPU, rank i's cores and threads (the run's core budget; None: one thread each, unpinned).
    """

    def __init__(
        self,
        factory: Callable[[], TrainBackend],
        placement: Placement,
        *,
        device: str = "cpu",
        timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        failure_grace_s: float = 2.0,
        wait: bool = True,
        shares: list[CoreShare] | None = None,
        log_dir: str | Path | None = None,
    ):
        """`log_dir`: where each rank writes its output (`trainer-<rank>.log`); None: Ray's worker files."""
        self.world_size = len(placement.plan.trainer_bundles)
        self.timeout_s, self.failure_grace_s, self.start_timeout_s = timeout_s, failure_grace_s, start_timeout_s
        self._closed = False
        self._infos: list[dict[str, Any]] | None = None
        self._ready_lock = threading.Lock()
        # Collective calls may come from several driver threads (a train step, an engine restart's export):
        # each is submitted to every rank under this lock, so all ranks run them in the same order.
        self._submit_lock = threading.Lock()
        self._actors = [
            _RemoteTrainerRank.options(**placement.actor_options("trainer", rank)).remote(
                rank, self.world_size, device, str(log_dir) if log_dir else None)
            for rank in range(self.world_size)
        ]
        rendezvous = self._actors[0].rendezvous.remote()  # each setup starts once rank 0 has answered
        self._setups = {actor.setup.remote(rendezvous, factory, timeout_s, shares[rank] if shares else None): rank
                        for rank, actor in enumerate(self._actors)}
        if wait:
            self.wait_ready()

    def wait_ready(self) -> TrainerActorGroup:
        """Block until every rank has built its backend (a failure shuts the group down and raises)."""
        with self._ready_lock:
            if self._infos is None:
                try:
                    self._infos = self._gather(self._setups, self.start_timeout_s, "start-up")
                except BaseException:
                    self.shutdown()  # interrupted too: no rank is left starting
                    raise
        return self

    @property
    def ready_infos(self) -> list[dict[str, Any]]:
        """`infos` once every rank is ready, else [] (never waits)."""
        return list(self._infos or [])

    @property
    def infos(self) -> list[dict[str, Any]]:
        """Per rank: rank, pid, node (address), node_id, placement_group, bundle, ready_at (wall clock, backend
        built)."""
        return self.wait_ready()._infos

    def __enter__(self) -> TrainerActorGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]

    # ---- the backend's methods ----------------------------------------------------------------
    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `backend.<method>(*args, **kwargs)` on every rank (or read the attribute); results by rank."""
        self._check_open(method)
        payload = self._payload(args, kwargs)
        with self._submit_lock:
            refs = {actor.call.remote(method, payload): rank for rank, actor in enumerate(self._actors)}
        return self._gather(refs, self.timeout_s, method)

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run `fn(backend, *args, **kwargs)` on every rank (e.g. a weight transport's rank-side push);
        `fn` must be picklable and collective-safe; each rank resolves an object reference in `args`.
        Results by rank."""
        self._check_open(getattr(fn, "__name__", "apply"))
        payload = self._payload(args, kwargs)
        with self._submit_lock:
            refs = {actor.apply.remote(fn, payload): rank for rank, actor in enumerate(self._actors)}
        return self._gather(refs, self.timeout_s, getattr(fn, "__name__", "apply"))

    def _payload(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | ray.ObjectRef:
        """A call's arguments: one copy in the object store when several ranks read them; a single rank's go
        with the call itself (Ray stores a large one on its own), which spares a put and a fetch a step."""
        return ray.put((args, kwargs)) if len(self._actors) > 1 else (args, kwargs)

    def set_cores(self, shares: list[CoreShare]) -> None:
        """Rank i computes on `shares[i]` from now on (call between steps)."""
        self._check_open("set_cores")
        with self._submit_lock:
            refs = {actor.set_cores.remote(shares[rank]): rank for rank, actor in enumerate(self._actors)}
        self._gather(refs, self.timeout_s, "set_cores")

    def open_weight_sync(self, sync: SyncConfig, engine_urls: list[str], **transport_options: Any) -> None:
        """Build the weight syncer in rank 0 (`transport_options` go to `verst.sync.build_transport`)."""
        self._check_open("open_weight_sync")
        ref = self._actors[0].open_weight_sync.remote(sync, list(engine_urls), transport_options)
        self._gather({ref: 0}, self.timeout_s, "open_weight_sync")

    def sync_weights(self, version: int, bucket_bytes: int, reconnect: bool = False,
                     first: bool = False) -> dict[str, float]:
        """Push the weights to the engines as `version` (from rank 0; every rank gathers); `sync/` metrics.
        `reconnect`: an engine was replaced since the last push (see `WeightSyncer.reconnect`); `first`: a
        LoRA run's step-0 adapter (`WeightSyncer.sync`)."""
        self._check_open("sync_weights")
        with self._submit_lock:
            refs = {actor.sync_weights.remote(version, bucket_bytes, reconnect, first): rank
                    for rank, actor in enumerate(self._actors)}
        return self._gather(refs, self.timeout_s, "sync_weights")[0]

    def close_weight_sync(self) -> None:
        if not self._closed:
            self._gather({self._actors[0].close_weight_sync.remote(): 0}, self.timeout_s, "close_weight_sync")

    def named_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Rank 0's buckets, streamed through the object store at most `STREAM_AHEAD_BUCKETS` ahead of
        the consumer; stopping early drains the rest so the ranks stay in step."""
        self._check_open("named_weights")
        with self._submit_lock:
            stream = self._actors[0].stream_weights.options(
                num_returns="streaming", _generator_backpressure_num_objects=STREAM_AHEAD_BUCKETS
            ).remote(bucket_bytes)
            others = {actor.drain_weights.remote(bucket_bytes): rank
                      for rank, actor in enumerate(self._actors) if rank}
        refs = self._stream(stream, others)
        finished = False
        try:
            for ref in refs:
                yield self._get(ref, 0, "named_weights")
            finished = True
        finally:
            if not finished and not self._closed:
                for _ in refs:  # the refs only: nothing is fetched
                    pass

    def _stream(self, stream: Any, others: dict[ray.ObjectRef, int]) -> Iterator[ray.ObjectRef]:
        """Refs of rank 0's buckets as they appear, watching the other ranks for failure meanwhile."""
        pending = dict(others)
        streaming = True
        while streaming or pending:
            waitables = ([stream] if streaming else []) + list(pending)
            ready, _ = ray.wait(waitables, num_returns=1, timeout=self.timeout_s)
            if not ready:
                ranks = ([0] if streaming else []) + sorted(pending.values())
                self.shutdown()
                raise TimeoutError(
                    f"trainer ranks {ranks} made no progress in 'named_weights' for {self.timeout_s:.0f} s")
            if ready[0] is stream:
                try:
                    yield next(stream)
                except StopIteration:
                    streaming = False
                continue
            rank = pending.pop(ready[0])
            self._get(ready[0], rank, "named_weights", pending)

    # ---- process management ----------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill every rank actor (Ray also ends their child processes). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for actor in self._actors:
            ray.kill(actor, no_restart=True)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"the trainer actor group is shut down (after shutdown() or a rank failure); cannot {what}")
        self.wait_ready()

    def _gather(self, refs: dict[ray.ObjectRef, int], timeout_s: float, what: str) -> list[Any]:
        """Every rank's result, by rank; the first failure (or the deadline) stops the group and raises."""
        results: dict[int, Any] = {}
        pending = dict(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                self.shutdown()
                raise TimeoutError(
                    f"trainer ranks {sorted(pending.values())} did not finish {what!r} within {timeout_s:.0f} s")
            rank = pending.pop(ready[0])
            results[rank] = self._get(ready[0], rank, what, pending)
        return [results[rank] for rank in sorted(results)]

    def _get(self, ref: ray.ObjectRef, rank: int, what: str, pending: dict[ray.ObjectRef, int] | None = None) -> Any:
        try:
            return ray.get(ref)
        except (ray.exceptions.RayError, GetTimeoutError) as error:
            failures = {rank: error, **self._more_failures(pending or {})}
            # A dead rank process is the cause; the others' collective errors are its consequence.
            dead = [r for r, e in failures.items() if isinstance(e, RayActorError)]
            culprit = min(dead) if dead else rank
            self.shutdown()
            raise RankError(culprit, _describe(failures[culprit], what)) from None

    def _more_failures(self, pending: dict[ray.ObjectRef, int]) -> dict[int, BaseException]:
        """Failures of other ranks within a short grace period after the first one."""
        if not pending:
            return {}
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.failure_grace_s)
        failures = {}
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as error:
                failures[pending[ref]] = error
        return failures


def _describe(error: BaseException, what: str) -> str:
    if isinstance(error, RayActorError):
        return f"its process died during {what!r}: {error}"
    return f"{what!r} raised: {error}"


def _quiet_transformers() -> None:
    """Per-rank progress bars and info logs of transformers would interleave on the driver's terminal.
    Through the environment it reads at import: a rank on the native model never imports transformers."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported already: its settings are read
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
