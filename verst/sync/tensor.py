"""The `tensor` transport for colocated engines: each bucket is handed over in memory, written once and
read by every engine. CPU: three reused /dev/shm files (`verst.inference_client.weights`); GPU: CUDA IPC (SGLang).
"""

from __future__ import annotations

import asyncio
import collections
import sys
from collections.abc import Iterable
from typing import Any

from verst.inference_client.fleet import EngineFleet
from verst.inference_client.weights import SHM_DIR, ShmSlot
from verst.sync.buckets import BucketStream
from verst.sync.transport import VERSIONED_UNLESS_ADAPTER, AdapterSpec, PushStats, TransportOptions
from verst.types import WeightBucket

IPC_MODES = ("shm", "cuda_ipc")


IPC_PIECE_BYTES = 64 * 2**20  # shm: the most one file holds (a bigger tensor goes alone)
SHM_FILES = 3  # shm files written in turn (the engine keeps as many mapped: `ShmReader`)


class TensorTransport:
    """`ipc="shm"`: the push goes in pieces of at most a third of a bucket and `IPC_PIECE_BYTES`, through
    three shared-memory files written in turn: the trainer writes the next piece while the engines copy
    the ones before it straight into their parameters (engines on this host; the embedded engine and
    `load_format="shm"`), so an engine finds the next piece waiting when it is done with one. Together
    the files hold at most one bucket, which bounds what an engine maps. They are kept and rewritten by
    every push, and deleted by `close()`. `ipc="cuda_ipc"`: SGLang's own scheme. With `adapter`, each
    push is the adapter in one shm file, which the engines serve under its name.
    """

    def __init__(self, fleet: EngineFleet, *, bucket_bytes: int, ipc: str = "shm", shm_dir: str = SHM_DIR,
                 adapter: AdapterSpec | None = None):
        if ipc not in IPC_MODES:
            raise ValueError(f"tensor transport ipc must be one of {IPC_MODES}, got {ipc!r}")
        if adapter is not None and ipc != "shm":
            raise ValueError("tensor transport: a LoRA adapter push goes through ipc='shm' only (the embedded "
                             "engine); use sync.transport = 'disk' or lora.sync = 'merged' with CUDA IPC")
        self.fleet, self.bucket_bytes, self.ipc, self.shm_dir = fleet, bucket_bytes, ipc, shm_dir
        self.adapter = adapter
        self._push_bytes = self._piece_bytes()
        self._slots = [ShmSlot(shm_dir) for _ in range(SHM_FILES)]
        self._tp_sizes: dict[str, int] = {}

    @classmethod
    def build(cls, fleet: EngineFleet, options: TransportOptions) -> TensorTransport:
        """Shared memory on CPU, CUDA IPC on CUDA."""
        return cls(fleet, bucket_bytes=options.bucket_bytes, ipc="cuda_ipc" if options.device == "cuda" else "shm",
                   adapter=options.adapter)

    versioned_loads = VERSIONED_UNLESS_ADAPTER

    def use_adapter(self, adapter: AdapterSpec | None) -> None:
        self.adapter = adapter
        self._push_bytes = self._piece_bytes()

    def _piece_bytes(self) -> int:
        """An adapter goes as one bucket: the engines build it from all of its tensors at once; shared memory
        goes in pieces, one written while the engines copy the others."""
        if self.adapter is not None:
            return sys.maxsize
        return max(1, min(self.bucket_bytes // SHM_FILES, IPC_PIECE_BYTES)) if self.ipc == "shm" else self.bucket_bytes

    async def push(self, buckets: Iterable[WeightBucket], version: int) -> dict[str, float]:
        stats, stream = PushStats(), BucketStream(buckets, self._push_bytes)
        try:
            if self.ipc == "shm":
                try:
                    await self._push_shm(stream, stats, version)
                except BaseException:
                    # an engine may still be copying from a slot it was abandoned on: the next push writes
                    # into new files instead of under its copy
                    await self.close()
                    raise
            else:
                async for bucket in stream:
                    await self._push_cuda_ipc(bucket, await self._version_with(stream, version))
                    stats.add(bucket)
        finally:
            await stream.aclose()
        return stats.metrics()

    async def _version_with(self, stream: BucketStream, version: int) -> str | None:
        """The version to send with the load of the bucket `stream` returned last: set by the last load."""
        return str(version) if self.versioned_loads and await stream.at_end() else None

    async def _push_shm(self, stream: BucketStream, stats: PushStats, version: int) -> None:
        """Each piece's load is sent as soon as it is written, queued behind the loads before it, so the
        engines go from one copy to the next without a round trip between. A slot is rewritten only once
        every engine has replied for the piece it held; the load that sets the version waits for every
        other to be done."""
        loads: collections.deque[asyncio.Future] = collections.deque()  # in flight, oldest first, one per slot
        adapter = {} if self.adapter is None else {"lora_name": self.adapter.name, "lora_config": self.adapter.config}
        try:
            async for bucket in stream:
                if len(loads) == len(self._slots):
                    await _done(loads)  # the slot this bucket goes into is free
                manifest = await self._write(self._slots[stats.buckets % len(self._slots)], bucket)
                weight_version = await self._version_with(stream, version)
                while weight_version is not None and loads:
                    await _done(loads)
                call = self.fleet.update_weights_from_tensor(manifest, weight_version, **adapter)  # type: ignore[arg-type]
                loads.append(asyncio.ensure_future(call))
                stats.add(bucket)
            while loads:
                await _done(loads)
        finally:
            for load in loads:  # an error elsewhere: stop waiting for these buckets' loads
                load.cancel()
            await asyncio.gather(*loads, return_exceptions=True)

    @staticmethod
    async def _write(slot: ShmSlot, bucket: WeightBucket) -> str:
        write = asyncio.ensure_future(asyncio.to_thread(slot.write, bucket))
        try:
            return await asyncio.shield(write)
        except asyncio.CancelledError:
            await asyncio.gather(write, return_exceptions=True)  # the thread finishes with the slot regardless
            raise

    # ---- GPU: CUDA IPC -------------------------------------------------------------------------------
    # UNTESTED HERE (no GPU, no sglang on the build machines). Written to SGLang's documented
    # `/update_weights_from_tensor`: `serialized_named_tensors` holds one entry per tensor-parallel rank of
    # the engine, each `MultiprocessingSerializer.serialize([(name, cuda_tensor), ...], output_str=True)`
    # after `monkey_patch_torch_reductions()` (devices travel as UUIDs, so engines with other
    # CUDA_VISIBLE_DEVICES map them right); `load_format` None. The engine copies out of the handles
    # before it replies, so the tensors only have to outlive the call.
    async def _push_cuda_ipc(self, bucket: WeightBucket, weight_version: str | None) -> None:
        serialize = _sglang_serializer()
        import torch

        tensors = [(name, tensor.detach().contiguous()) for name, tensor in bucket]
        off_gpu = [name for name, t in tensors if t.device.type != "cuda"]
        if off_gpu:
            raise ValueError(f"tensor transport ipc='cuda_ipc' needs CUDA tensors; {off_gpu[0]!r} is on the CPU")
        torch.cuda.synchronize()  # the engines read the memory as soon as they get the handles
        payload = serialize(tensors)
        tp_sizes = await self._engine_tp_sizes()

        async def send(client: Any) -> Any:
            body = {"serialized_named_tensors": [payload] * tp_sizes[client.base_url], "load_format": None,
                    "flush_cache": True, "weight_version": weight_version}
            # EngineClient has no public call for a raw serialized payload yet (reported); same POST path.
            return await client._post("/update_weights_from_tensor", body, client.timeouts.weights)

        await self.fleet.each("update_weights_from_tensor(cuda_ipc)", send)
        del tensors

    async def _engine_tp_sizes(self) -> dict[str, int]:
        if not self._tp_sizes:
            infos = await self.fleet.each("get_server_info", lambda c: c.get_server_info())
            self._tp_sizes = {url: int(info.get("tp_size", 1)) for url, info in infos.items()}
        return self._tp_sizes

    async def close(self) -> None:
        for slot in self._slots:
            slot.close()


async def _done(loads: collections.deque[asyncio.Future]) -> None:
    """Wait for the oldest load, then drop it (an error leaves it there for the caller's clean-up)."""
    await loads[0]
    loads.popleft()


def _sglang_serializer():
    """SGLang's serializer with its torch reduction patch applied; sglang must be installed here."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as exc:
        raise RuntimeError("tensor transport ipc='cuda_ipc' needs sglang installed in the trainer process "
                           "(its CUDA-IPC serializer); on CPU use ipc='shm'") from exc
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:  # older sglang releases keep it one level up
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    monkey_patch_torch_reductions()
    return lambda named: MultiprocessingSerializer.serialize(named, output_str=True)
