"""The `distributed` transport: a process-group broadcast from the process holding the full weights
(rank 0) to every engine (ranks 1..N, joined through `/init_weights_update_group`); gloo or NCCL. Each
bucket (one dtype) goes as one flattened broadcast (SGLang's `load_format="flattened_bucket"`).

The group is set up on the first push and reused. A push that fails part-way leaves the members out of
step (an engine that refused bucket k never ran that collective, so its next receive would pair with the
wrong send): the group is then dropped and a fresh one, under a new name, is built by the next push.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from verst.inference_client.fleet import EngineFleet, FleetError
from verst.inference_client.ports import free_port
from verst.inference_client.weights import (
    FLATTENED,
    FlatBuffer,
    WeightUpdateGroup,
    broadcast_flat,
    broadcast_tensors,
    dtype_name,
    open_weight_update_group,
)
from verst.sync.buckets import BucketStream
from verst.sync.transport import VERSIONED_UNLESS_ADAPTER, AdapterSpec, PushStats, TransportOptions
from verst.types import WeightBucket

log = logging.getLogger(__name__)
_thread_ids = itertools.count()
# collective threads still running -> when their op times out at the latest (see _in_collective_thread)
_COLLECTIVE_THREADS: dict[threading.Thread, float] = {}


class DistributedTransport:
    """Rank 0 of a weight-update group with every engine of `fleet`; `backend` "nccl" on GPUs (tensors
    are moved to `device` first), "gloo" on CPUs. `master_address` must be reachable from the engines.
    `timeout_s` bounds one collective on the trainer side: gloo cannot be interrupted, so after an engine
    refuses a bucket the push fails at once but the trainer's send to that engine stays blocked (in a
    daemon thread) until then, and a process exiting meanwhile waits for it. With `adapter`, each push is
    the adapter in one broadcast, which the engines serve under its name.
    """

    def __init__(
        self, fleet: EngineFleet, *, bucket_bytes: int, backend: str = "gloo", device: str = "cpu",
        master_address: str = "127.0.0.1", timeout_s: float = 60.0, adapter: AdapterSpec | None = None,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"distributed transport backend must be 'gloo' or 'nccl', got {backend!r}")
        self.fleet, self.bucket_bytes, self.backend = fleet, bucket_bytes, backend
        self.device, self.master_address, self.timeout_s = device, master_address, timeout_s
        self.adapter = adapter
        # an adapter goes as one bucket: the engines build it from all of its tensors at once
        self._push_bytes = sys.maxsize if adapter is not None else bucket_bytes
        self.group: WeightUpdateGroup | None = None
        self._flat = FlatBuffer(device)  # the trainer's packed bucket, kept from push to push
        self.groups_built = 0  # 1 in a healthy run; each failed push adds one rebuild

    @classmethod
    def build(cls, fleet: EngineFleet, options: TransportOptions) -> DistributedTransport:
        """gloo on CPU, NCCL on CUDA, rooted at `options.master_address`."""
        return cls(fleet, bucket_bytes=options.bucket_bytes, backend="nccl" if options.device == "cuda" else "gloo",
                   device=options.device, master_address=options.master_address, timeout_s=options.timeout_s,
                   adapter=options.adapter)

    versioned_loads = VERSIONED_UNLESS_ADAPTER

    def use_adapter(self, adapter: AdapterSpec | None) -> None:
        self.adapter = adapter
        self._push_bytes = sys.maxsize if adapter is not None else self.bucket_bytes

    async def connect(self) -> None:
        """Build the group unless one is up: the trainer joins as rank 0 while every engine joins over HTTP."""
        if self.group is not None:
            return
        self.groups_built += 1
        name = f"verst-weights-{os.getpid()}-{self.groups_built}-{uuid.uuid4().hex[:8]}"
        port = free_port(self.master_address)
        world = len(self.fleet.urls) + 1
        local = _in_collective_thread(open_weight_update_group, self.master_address, port, 0, world, name,
                                  self.backend, self.timeout_s, timeout_s=self.timeout_s)
        ranks = {url: i + 1 for i, url in enumerate(self.fleet.urls)}  # EngineFleet's convention
        remote = _each(self.fleet, lambda url, c: c.init_weights_update_group(
            self.master_address, port, ranks[url], world, name, self.backend))
        await _collective(local, remote, f"init_weights_update_group({name!r} at {self.master_address}:{port})")
        self.group = local.result()
        log.info("weight update group %s up: trainer + %d engines", name, world - 1)

    async def push(self, buckets: Iterable[WeightBucket], version: int) -> dict[str, float]:
        await self.connect()
        # full weights in one-dtype buckets, each one broadcast; an adapter is one bucket whatever its dtypes
        stats, stream = PushStats(), BucketStream(buckets, self._push_bytes, by_dtype=self.adapter is None)
        try:
            async for bucket in stream:
                last = self.versioned_loads and await stream.at_end()
                await self._push_bucket(bucket, stats.buckets, str(version) if last else None)
                stats.add(bucket)
        except BaseException:
            self.group = None
            # a collective abandoned on the old group may still read this buffer: the next push packs elsewhere
            self._flat = FlatBuffer(self.device)
            raise
        finally:
            await stream.aclose()
        return stats.metrics()

    async def _push_bucket(self, bucket: WeightBucket, index: int, weight_version: str | None) -> None:
        group = self.group
        assert group is not None
        names = [name for name, _ in bucket]
        tensors = [tensor.detach() for _, tensor in bucket]
        dtypes = [dtype_name(t.dtype) for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        flat = len(set(dtypes)) == 1
        extra: dict[str, Any] = {"load_format": FLATTENED} if flat else {}
        if self.adapter is not None:
            extra.update(lora_name=self.adapter.name, lora_config=self.adapter.config)
        remote = _each(self.fleet, lambda url, c: c.update_weights_from_distributed(
            names, dtypes, shapes, weight_version, group.name, **extra))  # type: ignore[arg-type]
        if flat:
            local = _in_collective_thread(broadcast_flat, group, tensors, self._flat, timeout_s=self.timeout_s)
        else:  # an adapter of mixed dtypes: a broadcast per tensor
            tensors = [t.to(self.device).contiguous() for t in tensors]
            local = _in_collective_thread(broadcast_tensors, group, tensors, timeout_s=self.timeout_s)
        await _collective(local, remote, f"update_weights_from_distributed(bucket {index}: {len(names)} tensors "
                                         f"from {names[0]!r})")

    async def close(self) -> None:
        # Dropping the trainer's side closes its connections; engines forget a group when they stop.
        self.group = None
        self._flat.release()


def _each(fleet: EngineFleet, call: Callable[[str, Any], Any]) -> dict[str, asyncio.Future]:
    """One future per engine (not `fleet.each`, which waits for all: an engine blocked in a collective
    whose peer refused would hold back the refusal until the collective times out)."""
    return {url: asyncio.ensure_future(call(url, client)) for url, client in fleet.clients.items()}


async def _collective(local: asyncio.Future, remote: dict[str, asyncio.Future], action: str) -> None:
    """Wait for the trainer's side and every engine's side of one collective; the first failure wins.

    Engines that refused are named at once (`FleetError`); the rest are abandoned, as is the trainer's
    side, which may stay blocked until the group timeout (the group is then rebuilt by the next push).
    """
    pending = {local, *remote.values()}
    try:
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failures = {url: f.exception() for url, f in remote.items()
                        if f.done() and not f.cancelled() and f.exception() is not None}
            if failures:
                raise FleetError(action, failures)  # type: ignore[arg-type]
            if local.done() and local.exception() is not None:
                raise RuntimeError(f"{action}: the trainer side failed: {type(local.exception()).__name__}: "
                                   f"{local.exception()}") from local.exception()
    finally:
        for future in remote.values():
            future.cancel()  # no-op for the finished ones


def _in_collective_thread(fn: Callable[..., Any], *args: Any, timeout_s: float) -> asyncio.Future:
    """`fn(*args)` (one side of a collective bounded by `timeout_s`) in a thread, as a future of this loop.

    Not `asyncio.to_thread`: a push must be able to fail at once while its collective is still blocked
    (gloo cannot be interrupted; the op ends at the group timeout). Such a thread is waited for at exit,
    at most `timeout_s`: tearing gloo down under a blocked collective aborts the process.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned failure is not "unretrieved"

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:  # handed to the awaiting coroutine
            outcome = (False, exc)
        finally:
            _COLLECTIVE_THREADS.pop(threading.current_thread(), None)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is closed: the push that waited for this has already failed and returned

    thread = threading.Thread(target=run, daemon=True, name=f"verst-weight-collective-{next(_thread_ids)}")
    _COLLECTIVE_THREADS[thread] = time.monotonic() + timeout_s
    thread.start()
    return future


@atexit.register
def _wait_for_collectives() -> None:
    for thread, deadline in list(_COLLECTIVE_THREADS.items()):
        remaining = deadline - time.monotonic()
        if thread.is_alive() and remaining > 0:
            log.warning("waiting up to %.0f s for an abandoned weight-sync collective to time out", remaining)
            thread.join(remaining + 5.0)
