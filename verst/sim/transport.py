"""The `sim` weight transport: the distributed transport's requests to every engine (the group joined once,
then one `update_weights_from_distributed` per bucket with its names, dtypes and shapes, the last carrying the
version), without the broadcast itself: a simulated engine charges the bucket's bytes over its link bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterable

from verst.inference_client.fleet import EngineFleet
from verst.sync.buckets import BucketStream
from verst.sync.transport import AdapterSpec, PushStats, TransportOptions
from verst.types import WeightBucket

GROUP = "verst_sim_weights"


class SimTransport:
    """Pushes declared weights (`verst.sim.trainer.DeclaredTensor`) to every engine of `fleet`."""

    versioned_loads = True  # each load flushes; the last one sets the version

    def __init__(self, fleet: EngineFleet, bucket_bytes: int):
        self.fleet, self.bucket_bytes = fleet, bucket_bytes
        self.joined = False

    @classmethod
    def build(cls, fleet: EngineFleet, options: TransportOptions) -> SimTransport:
        if options.adapter is not None:
            raise ValueError("sync.transport = 'sim' pushes full weights; LoRA's adapter sync is not simulated")
        return cls(fleet, options.bucket_bytes)

    def use_adapter(self, adapter: AdapterSpec | None) -> None:
        if adapter is not None:
            raise ValueError("sync.transport = 'sim' pushes full weights; LoRA's adapter sync is not simulated")

    async def push(self, buckets: Iterable[WeightBucket], version: int) -> dict[str, float]:
        if not self.joined:
            await self.fleet.init_weights_update_group("127.0.0.1", 0, GROUP)
            self.joined = True
        stats, stream = PushStats(), BucketStream(buckets, self.bucket_bytes, by_dtype=True)
        try:
            async for bucket in stream:
                last = await stream.at_end()
                names = [name for name, _ in bucket]
                dtypes = [tensor.dtype for _, tensor in bucket]
                shapes = [list(tensor.shape) for _, tensor in bucket]
                await self.fleet.update_weights_from_distributed(names, dtypes, shapes, str(version) if last else None,
                                                                 GROUP, load_format="flattened_bucket")
                stats.add(bucket)
        except BaseException:
            self.joined = False  # as the distributed transport's group, rebuilt by the next push
            raise
        finally:
            await stream.aclose()
        return stats.metrics()

    async def close(self) -> None:
        self.joined = False
