"""Rank 0's weight syncer in a process of its own, as on a real run, where it lives in the trainer rank's process:
a push's fan-out (one request per bucket per engine) then spends neither the driver's CPU nor its GIL, which the
rollout manager's thread shares. The simulated trainer calls it through a pipe, one call at a time.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
from typing import Any

from verst.config import SyncConfig
from verst.sync.syncer import SyncFailure, WeightSyncError
from verst.types import WeightBucket

CLOSE_TIMEOUT_S = 30.0


class SyncerProcess:
    """`SyncerLoop` (`verst.orchestration.rank_sync`) in a spawned child; `plugins` are imported there first
    (the simulation's transport is registered by one)."""

    def __init__(self, sync: SyncConfig, engine_urls: list[str], options: dict[str, Any], plugins: list[str]):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, sync, engine_urls, options, plugins),
                                       name="verst-sim-weight-sync", daemon=True)
        self.process.start()
        child.close()
        try:
            self.call("ready")
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def sync(self, buckets: list[WeightBucket], version: int, first: bool, reconnect: bool
             ) -> dict[str, float] | SyncFailure:
        return self.call("sync", buckets, version, first, reconnect)

    def call(self, name: str, *args: Any) -> Any:
        try:
            self.conn.send((name, args))
            ok, value = self.conn.recv()
        except (EOFError, OSError) as error:
            raise RuntimeError(f"the simulated trainer's weight-sync process (pid {self.pid}) died: exit code "
                               f"{self.process.exitcode}") from error
        if not ok:
            raise value
        return value

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self.call("close")
        finally:
            self.kill()

    def kill(self) -> None:
        self.process.join(CLOSE_TIMEOUT_S if self.process.is_alive() else 0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def serve(conn: multiprocessing.connection.Connection, sync: SyncConfig, engine_urls: list[str],
          options: dict[str, Any], plugins: list[str]) -> None:
    """The child: open the syncer, then answer calls until `close` or until the parent's end of the pipe closes."""
    from verst.config.imports import import_plugins
    from verst.orchestration.rank_sync import SyncerLoop

    try:
        import_plugins(plugins)
        loop = SyncerLoop(sync, engine_urls, options)
    except BaseException as error:
        conn.send((False, portable(error)))
        return
    try:
        while True:
            try:
                name, args = conn.recv()
            except EOFError:  # the parent is gone
                return
            try:
                if name == "ready":
                    conn.send((True, None))
                elif name == "close":
                    conn.send((True, None))
                    return
                else:
                    conn.send((True, push(loop, *args)))
            except BaseException as error:
                conn.send((False, portable(error)))
    finally:
        loop.close()


def push(loop: Any, buckets: list[WeightBucket], version: int, first: bool, reconnect: bool
         ) -> dict[str, float] | SyncFailure:
    try:
        if reconnect:
            loop.run(loop.syncer.reconnect())
        return loop.sync(iter(buckets), version, first)
    except WeightSyncError as error:  # an engine failed: the trainer lives on
        return SyncFailure(str(error))


def portable(error: BaseException) -> BaseException:
    """`error` if it pickles, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
