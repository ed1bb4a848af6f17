"""The `tensor` transport for colocated engines: each bucket is handed over in memory as SGLang's
`serialized_named_tensors` (`verst.inference_client.tensor_payload`), the one format the embedded engine and
SGLang take: CUDA tensors as CUDA-IPC handles, CPU tensors as shared-memory storages.
"""

from __future__ import annotations

import asyncio
import collections
import sys
from collections.abc import Callable, Iterable

from verst.inference_client.fleet import EngineFleet
from verst.inference_client.tensor_payload import SharedStaging, serialize_named_tensors
from verst.sync.buckets import BucketStream
from verst.sync.transport import VERSIONED_UNLESS_ADAPTER, AdapterSpec, PushStats, TransportOptions
from verst.types import WeightBucket

PIECE_BYTES = 64 * 2**20  # the most one piece holds (a bigger tensor goes alone)
STAGES = 3  # pieces in flight at once; on CPU, the shared-memory buffers written in turn


class TensorTransport:
    """The push goes in pieces of at most a third of a bucket and `PIECE_BYTES`, up to three loads in flight:
    each piece's load is sent as soon as it is ready, queued behind the ones before it, so an engine finds
    the next piece waiting when it is done with one. On CPU each piece is copied into one of three
    shared-memory buffers kept from push to push (`SharedStaging`), the trainer writing the next while the
    engines copy the ones before it straight into their parameters; together they hold at most one bucket.
    On CUDA the engines copy straight from the trainer's tensors, which stay alive until their loads reply.
    With `adapter`, each push is the adapter as one piece, which the engines serve under its name (the
    embedded engine's extension of the load).
    """

    def __init__(self, fleet: EngineFleet, *, bucket_bytes: int, adapter: AdapterSpec | None = None):
        self.fleet, self.bucket_bytes, self.adapter = fleet, bucket_bytes, adapter
        self._push_bytes = self._piece_bytes()
        self._staging = [SharedStaging() for _ in range(STAGES)]
        self._tp_sizes: dict[str, int] = {}

    @classmethod
    def build(cls, fleet: EngineFleet, options: TransportOptions) -> TensorTransport:
        """The same on CPU and CUDA: each tensor goes as its device allows (see the class)."""
        return cls(fleet, bucket_bytes=options.bucket_bytes, adapter=options.adapter)

    versioned_loads = VERSIONED_UNLESS_ADAPTER

    def use_adapter(self, adapter: AdapterSpec | None) -> None:
        self.adapter = adapter
        self._push_bytes = self._piece_bytes()

    def _piece_bytes(self) -> int:
        """An adapter goes as one piece: the engines build it from all of its tensors at once; full weights go
        in pieces, one staged while the engines copy the others."""
        return sys.maxsize if self.adapter is not None else max(1, min(self.bucket_bytes // STAGES, PIECE_BYTES))

    async def push(self, buckets: Iterable[WeightBucket], version: int) -> dict[str, float]:
        stats, stream = PushStats(), BucketStream(buckets, self._push_bytes)
        try:
            await self._push(stream, stats, version)
        except BaseException:
            # an engine may still be copying from a buffer it was abandoned on: the next push stages into new ones
            await self.close()
            raise
        finally:
            await stream.aclose()
        return stats.metrics()

    async def _version_with(self, stream: BucketStream, version: int) -> str | None:
        """The version to send with the load of the bucket `stream` returned last: set by the last load."""
        return str(version) if self.versioned_loads and await stream.at_end() else None

    async def _push(self, stream: BucketStream, stats: PushStats, version: int) -> None:
        """A piece's buffer is rewritten only once every engine has replied for the piece it held; the load
        that sets the version waits for every other to be done."""
        loads: collections.deque[asyncio.Future] = collections.deque()  # in flight, oldest first
        adapter = {} if self.adapter is None else {"lora_name": self.adapter.name, "lora_config": self.adapter.config}
        try:
            async for bucket in stream:
                if len(loads) == STAGES:
                    await _done(loads)  # the buffer this piece goes into is free
                named = await self._stage(self._staging[stats.buckets % STAGES], bucket)
                weight_version = await self._version_with(stream, version)
                while weight_version is not None and loads:
                    await _done(loads)
                payloads = await self._payloads(named)
                loads.append(asyncio.ensure_future(
                    self.fleet.update_weights_from_tensor(payloads, weight_version, **adapter)))  # type: ignore[arg-type]
                stats.add(bucket)
            while loads:
                await _done(loads)
        finally:
            for load in loads:  # an error elsewhere: stop waiting for these pieces' loads
                load.cancel()
            await asyncio.gather(*loads, return_exceptions=True)

    @staticmethod
    async def _stage(staging: SharedStaging, bucket: WeightBucket) -> WeightBucket:
        """CPU tensors copied into a shared-memory buffer; CUDA tensors as they are (IPC shares them)."""
        devices = {tensor.device.type for _, tensor in bucket}
        if devices == {"cuda"}:
            return [(name, tensor.detach().contiguous()) for name, tensor in bucket]
        if devices != {"cpu"}:
            raise ValueError(f"tensor transport: a bucket's tensors must all be on the CPU or all on CUDA, got "
                             f"{sorted(devices)}")
        copy = asyncio.ensure_future(asyncio.to_thread(staging.stage, bucket))
        try:
            return await asyncio.shield(copy)
        except asyncio.CancelledError:
            await asyncio.gather(copy, return_exceptions=True)  # the thread finishes with the buffer regardless
            raise

    async def _payloads(self, named: WeightBucket) -> Callable[[str], list[str]]:
        """Each engine's own pickles of the piece, one per tensor-parallel rank of it."""
        if not self._tp_sizes:
            infos = await self.fleet.each("get_server_info", lambda c: c.get_server_info())
            self._tp_sizes = {url: int(info.get("tp_size", 1)) for url, info in infos.items()}
        return lambda url: [serialize_named_tensors(named) for _ in range(self._tp_sizes[url])]

    async def close(self) -> None:
        for staging in self._staging:
            staging.close()


async def _done(loads: collections.deque[asyncio.Future]) -> None:
    """Wait for the oldest load, then drop it (an error leaves it there for the caller's clean-up)."""
    await loads[0]
    loads.popleft()
