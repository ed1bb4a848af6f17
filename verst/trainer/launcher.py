"""verst's own rank launcher: `TrainerGroup` spawns N worker processes on this machine, each hosting
one backend rank, and runs every backend method on all ranks from the driver.

Failure model: a rank that raises or dies makes the driver raise `RankError` with that rank's
traceback; a call that outlives its timeout raises `TimeoutError`. Either way the group is stopped
(its collectives are in an unknown state), so the driver never hangs on a broken group.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable, Generator, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from verst.trainer.backend import CollectiveCalls, RankError, TrainBackend
from verst.trainer.distributed import init_process_group, resolve_device
from verst.types import WeightBucket

LOOPBACK = "127.0.0.1"
_SHUTDOWN = "__shutdown__"
# Imported once by the fork server. transformers.models.auto.modeling_auto pulls in the lazy model
# registry scan that every AutoModel call would otherwise repeat in each rank.
_PRELOAD = [
    "torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "transformers", "transformers.modeling_utils", "transformers.masking_utils",
    "transformers.generation.utils", "transformers.models.auto.modeling_auto", "verst.trainer.fsdp",
]


class TrainerGroup(CollectiveCalls):
    """N ranks of a backend, driven from this process; use as a context manager.

    `factory()` builds the backend inside each rank after the process group is up; it must be
    picklable (a module-level function or a functools.partial of a class) and agree with `device`.
    Every method runs on all ranks; results come from rank 0 (the ranks' results are identical).
    """

    def __init__(
        self,
        factory: Callable[[], TrainBackend],
        world_size: int,
        *,
        device: str = "cpu",
        timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
    ):
        if world_size < 1:
            raise ValueError(f"cluster.trainer_ranks must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        self._closed = False
        # The rendezvous store lives in the driver on a port the OS picked, so there is no race
        # for a free MASTER_PORT; ranks connect to it as clients.
        self._store = dist.TCPStore(LOOPBACK, 0, None, is_master=True,
                                    timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=False)
        self.master_port = self._store.port
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        try:
            self._start(factory, device, timeout_s)
            self._finish(self._replies(start_timeout_s, "start-up"), "start-up")
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def _start(self, factory: Callable[[], TrainBackend], device: str, timeout_s: float) -> None:
        # Ranks fork from a server that has already imported the heavy modules (about 10 s of
        # imports per process on a small CPU machine), so every group after the first starts fast.
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        for rank in range(self.world_size):
            parent, child = context.Pipe(duplex=True)
            proc = context.Process(
                target=_worker_main,
                args=(rank, self.world_size, self.master_port, child, factory, device, timeout_s),
                name=f"verst-trainer-rank{rank}",
                daemon=True,
            )
            self._conns.append(parent)
            self._procs.append(proc)
            proc.start()
            child.close()

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # After an exception (even a driver-side interrupt) ranks may be mid-collective: no asking.
        self.shutdown(graceful=exc_type is None)

    # ---- the backend's methods ----------------------------------------------------------------
    def named_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Rank 0's buckets, streamed one at a time; stopping early drains the rest."""
        exchange = self._exchange("named_weights", (bucket_bytes,), {})
        finished = False
        try:
            # A plain loop, not `yield from`: closing this generator must not close the exchange,
            # whose remaining replies are drained below to keep the ranks in step.
            for bucket in exchange:
                yield bucket
            finished = True
        finally:
            if not finished and not self._closed:
                for _ in exchange:
                    pass

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `backend.<method>(*args, **kwargs)` on every rank (or read the attribute `method`);
        the results, by rank."""
        return self._finish(self._exchange(method, args, kwargs), method)

    # ---- process management ----------------------------------------------------------------
    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank: ask (when `graceful`), then terminate, then kill. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            for conn, proc in zip(self._conns, self._procs):
                if proc.is_alive():
                    try:
                        conn.send_bytes(pickle.dumps((_SHUTDOWN, (), {})))
                    except (BrokenPipeError, OSError):
                        pass
            deadline = time.monotonic() + 10.0
            for proc in self._procs:
                if proc.is_alive():
                    proc.join(max(deadline - time.monotonic(), 0.0))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._store = None

    def _exchange(self, method: str, args: tuple, kwargs: dict) -> Generator[Any, None, list[Any]]:
        if self._closed:
            raise RuntimeError("the trainer group is shut down (after shutdown() or a rank failure)")
        message = pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:  # BrokenPipeError: the rank died between calls
                code = self._procs[rank].exitcode
                self.shutdown(graceful=False)
                raise RankError(rank, f"process exited with code {code} before {method!r}") from None
        return (yield from self._replies(self.timeout_s, method))

    def _finish(self, replies: Generator[Any, None, list[Any]], what: str) -> list[Any]:
        """Run a non-streaming exchange to its per-rank results."""
        try:
            next(replies)
        except StopIteration as done:
            return done.value
        self.shutdown(graceful=False)
        raise RuntimeError(f"{what!r} streamed results; only named_weights may")

    def _replies(self, timeout_s: float, what: str) -> Generator[Any, None, list[Any]]:
        """Yield rank 0's streamed items; return every rank's final result, by rank."""
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.shutdown(graceful=False)
                raise TimeoutError(f"trainer ranks {sorted(pending)} did not finish {what!r} within {timeout_s:.0f} s")
            waitables = {self._conns[r]: r for r in pending} | {self._procs[r].sentinel: r for r in pending}
            for ready in wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                conn = self._conns[rank]
                try:
                    if ready is not conn and not conn.poll():
                        raise EOFError
                    kind, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._procs[rank].join(5.0)  # a closed pipe means the process is exiting
                    code = self._procs[rank].exitcode
                    self.shutdown(graceful=False)
                    raise RankError(rank, f"process exited with code {code} during {what!r}") from None
                if kind == "error":
                    self.shutdown(graceful=False)  # the other ranks may be stuck in a collective
                    raise RankError(rank, payload)
                if kind == "stream":
                    yield payload
                    continue
                results[rank] = payload
                pending.discard(rank)
        return results


# ---- the rank side -----------------------------------------------------------------------------
def _worker_main(rank: int, world_size: int, port: int, conn: Connection,
                 factory: Callable[[], TrainBackend], device: str, timeout_s: float) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        resolved = resolve_device(device)
        if resolved.type == "cpu":
            torch.set_num_threads(1)
        _quiet_transformers()
        init_process_group(rank, world_size, LOOPBACK, port, resolved, timeout_s)
        backend = factory()
    except BaseException:
        _reply(conn, "error", traceback.format_exc())
        return
    _reply(conn, "ok", None)
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the driver went away
        if method == _SHUTDOWN:
            break
        try:
            if method == "named_weights":
                for bucket in backend.named_weights(*args, **kwargs):
                    if rank == 0:
                        _reply(conn, "stream", [(name, tensor.cpu()) for name, tensor in bucket])
                result = None
            else:
                attribute = getattr(backend, method)
                result = attribute(*args, **kwargs) if callable(attribute) else attribute
        except BaseException:
            _reply(conn, "error", traceback.format_exc())
            continue
        _reply(conn, "ok", result)
    dist.destroy_process_group()


def _reply(conn: Connection, kind: str, payload: Any) -> None:
    conn.send_bytes(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def _quiet_transformers() -> None:
    """Per-rank progress bars and info logs of transformers would interleave on the driver's terminal."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
