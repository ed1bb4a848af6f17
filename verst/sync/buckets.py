"""Weight buckets for transports: regroup a stream of named tensors to a byte bound, and read the next
bucket in a worker thread while the current one is pushed (the source blocks: gathers, pipes, disk).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from verst.types import WeightBucket

_END = object()


def tensor_nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def rebucket(buckets: Iterable[WeightBucket], bucket_bytes: int, by_dtype: bool = False) -> Iterator[WeightBucket]:
    """The same tensors in the same order, in buckets of at most `bucket_bytes` (a bigger tensor goes
    alone); with `by_dtype`, a bucket also ends where the dtype changes (a flattened bucket has one dtype).
    A name seen twice is refused: the second copy would silently overwrite the first."""
    if bucket_bytes < 1:
        raise ValueError(f"sync.bucket_bytes must be >= 1, got {bucket_bytes}")
    seen: set[str] = set()
    out: WeightBucket = []
    size = 0
    for bucket in buckets:
        for name, tensor in bucket:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice in one weight push")
            seen.add(name)
            nbytes = tensor_nbytes(tensor)
            if out and (size + nbytes > bucket_bytes or (by_dtype and tensor.dtype != out[-1][1].dtype)):
                yield out
                out, size = [], 0
            out.append((name, tensor))
            size += nbytes
    if out:
        yield out


class BucketStream:
    """`async for bucket in BucketStream(source, bucket_bytes)`; bucket k+1 is read from `source` in a
    thread while bucket k is pushed (peak memory: two buckets). Always `await stream.aclose()`: it closes
    the source, which lets a stream of N ranks drain them after an early stop.
    """

    def __init__(self, source: Iterable[WeightBucket], bucket_bytes: int, by_dtype: bool = False):
        self._source = iter(source)
        self._buckets = rebucket(self._source, bucket_bytes, by_dtype)
        self._pending: asyncio.Future | None = None
        # A generator may not be resumed from two threads at once; reads are serialised anyway, the lock
        # also covers aclose racing a cancelled read.
        self._lock = threading.Lock()

    def _next(self) -> Any:
        with self._lock:
            return next(self._buckets, _END)

    def _read(self) -> asyncio.Future:
        return asyncio.ensure_future(asyncio.to_thread(self._next))

    def __aiter__(self) -> BucketStream:
        return self

    async def __anext__(self) -> WeightBucket:
        pending = self._pending if self._pending is not None else self._read()
        self._pending = None
        bucket = await pending
        if bucket is _END:
            raise StopAsyncIteration
        self._pending = self._read()
        return bucket

    async def at_end(self) -> bool:
        """Whether the bucket last returned is the last one: waits for the read of the next (started when
        that bucket was returned) without taking it, so a transport can send the version with the last load."""
        if self._pending is None:
            return True
        return (await asyncio.shield(self._pending)) is _END

    async def aclose(self) -> None:
        if self._pending is not None:
            await asyncio.gather(self._pending, return_exceptions=True)
            self._pending = None

        def close() -> None:
            with self._lock:
                self._buckets.close()
                closer = getattr(self._source, "close", None)
                if closer is not None:
                    closer()

        await asyncio.to_thread(close)


class PrefetchedSource:
    """A bucket source whose first bucket is read before the push starts: `await
    PrefetchedSource.read_first(source)` gathers it (for a trainer group: the full-weight gather and its
    trip through the object store, most of a small model's push), so the syncer does that
    before it pauses the engines. Iterating yields that bucket, then the rest of `source`; `close()`
    closes `source`, as a transport's `BucketStream.aclose` expects of any source."""

    def __init__(self, first: Any, source: Iterator[WeightBucket]):
        self._first, self._source = first, source

    @classmethod
    async def read_first(cls, source: Iterable[WeightBucket]) -> PrefetchedSource:
        iterator = iter(source)
        read = asyncio.ensure_future(asyncio.to_thread(next, iterator, _END))
        try:
            return cls(await asyncio.shield(read), iterator)
        except asyncio.CancelledError:
            # The read goes on in its thread: let it end, then close the source (which lets a trainer
            # group's stream drain its other ranks), as BucketStream.aclose does.
            await asyncio.gather(read, return_exceptions=True)
            cls(_END, iterator).close()
            raise

    def __iter__(self) -> Iterator[WeightBucket]:
        if self._first is not _END:
            first, self._first = self._first, _END
            yield first
        yield from self._source

    def close(self) -> None:
        self._first = _END
        closer = getattr(self._source, "close", None)
        if closer is not None:
            closer()
