"""The weight-sync lifecycle in `WeightSyncer`, against a fleet that records calls (the engines are the
edge here; the real ones are in tests/component/test_sync_transports.py): order, versions, failures."""

import asyncio

import pytest
import torch

from verst.config.schema import SyncConfig
from verst.inference_client.fleet import FleetError
from verst.sync import VersionError, WeightSyncer, WeightSyncError, build_syncer, build_transport
from verst.sync.disk import DiskTransport
from verst.sync.distributed import DistributedTransport
from verst.sync.tensor import TensorTransport


class RecordingClient:
    def __init__(self, url, log, fail):
        self.base_url, self.log, self.fail = url, log, fail

    async def get_server_info(self):
        return {"tp_size": 1}

    async def update_weight_version(self, version):
        self.log.append(("update_weight_version", self.base_url, version))
        return {"success": True, "weight_version": version}


class RecordingFleet:
    """EngineFleet's surface as the syncer uses it; `fail` maps an action to the URLs that fail it."""

    def __init__(self, urls=("http://a", "http://b"), versions=None, fail=None):
        self.urls, self.log, self.fail = list(urls), [], fail or {}
        self.versions = versions or {url: "0" for url in self.urls}
        self.clients = {url: RecordingClient(url, self.log, self.fail) for url in self.urls}

    async def _all(self, action, *args):
        self.log.append((action, *args))
        failing = self.fail.get(action, ())
        if failing:
            raise FleetError(action, {url: RuntimeError(f"{action} refused") for url in failing})
        return {url: {"success": True} for url in self.urls}

    async def pause(self, mode="retract"):
        return await self._all("pause", mode)

    async def flush_cache(self):
        return await self._all("flush_cache")

    async def continue_generation(self):
        return await self._all("continue_generation")

    async def weight_versions(self):
        return dict(self.versions)

    async def each(self, action, fn):
        return {url: await fn(client) for url, client in self.clients.items()}


class RecordingTransport:
    versioned_loads = False

    def __init__(self, log, error=None):
        self.log, self.error, self.closed = log, error, False

    async def push(self, buckets, version):
        tensors = [name for bucket in buckets for name, _ in bucket]
        self.log.append(("push", version, tensors))
        if self.error:
            raise self.error
        return {"sync/bytes": 12.0, "sync/buckets": 1.0, "sync/tensors": float(len(tensors)), "sync/push_seconds": 0.0}

    async def close(self):
        self.closed = True


BUCKETS = [[("w", torch.zeros(3))]]


def syncer_for(fleet, mode="retract", error=None, **kwargs):
    return WeightSyncer(fleet, RecordingTransport(fleet.log, error), pause_mode=mode, **kwargs)


def actions(log):
    return [entry[0] for entry in log]


def test_lifecycle_order_pause_flush_push_version_continue():
    fleet = RecordingFleet()
    metrics = asyncio.run(syncer_for(fleet).sync(BUCKETS, 1))
    assert actions(fleet.log) == ["pause", "flush_cache", "push", "update_weight_version", "update_weight_version",
                                  "continue_generation"]
    assert fleet.log[0] == ("pause", "retract")
    assert {entry[1:] for entry in fleet.log if entry[0] == "update_weight_version"} == {("http://a", "1"),
                                                                                         ("http://b", "1")}
    assert metrics["sync/version"] == 1 and "sync/transport_id" not in metrics
    assert metrics["sync/tensors"] == 1 and metrics["sync/seconds"] >= 0


def test_in_place_pause_keeps_the_cache():
    fleet = RecordingFleet()
    asyncio.run(syncer_for(fleet, mode="in_place").sync(BUCKETS, 1))
    assert fleet.log[0] == ("pause", "in_place") and "flush_cache" not in actions(fleet.log)


def logged_source(log, buckets):
    """A trainer-like bucket stream that logs each read and its close."""
    try:
        for index, bucket in enumerate(buckets):
            log.append(("read", index))
            yield bucket
    finally:
        log.append(("source_closed",))


def test_the_first_bucket_is_read_before_the_engines_pause():
    # The trainer's gather of the first bucket is not engine idle time: only the push is.
    fleet = RecordingFleet()
    two = [[("w", torch.zeros(3))], [("b", torch.zeros(1))]]
    metrics = asyncio.run(syncer_for(fleet).sync(logged_source(fleet.log, two), 1))
    assert actions(fleet.log)[:5] == ["read", "pause", "flush_cache", "read", "source_closed"]
    assert fleet.log[5] == ("push", 1, ["w", "b"])  # every bucket, in order, after the prefetched one
    assert 0 <= metrics["sync/paused_seconds"] <= metrics["sync/seconds"]


def test_a_failed_pause_closes_the_prefetched_source():
    fleet = RecordingFleet(fail={"pause": ["http://b"]})
    with pytest.raises(WeightSyncError, match="pause refused"):
        asyncio.run(syncer_for(fleet).sync(logged_source(fleet.log, BUCKETS * 2), 1))
    assert actions(fleet.log) == ["read", "pause", "source_closed", "continue_generation"]


def test_a_sync_cancelled_while_reading_the_first_bucket_closes_the_source():
    import threading

    log, release = [], threading.Event()

    def slow_source():
        try:
            release.wait(10)  # the trainer's gather, still running when the sync is cancelled
            log.append(("read", 0))
            yield [("w", torch.zeros(1))]
        finally:
            log.append(("source_closed",))

    async def main():
        fleet, source = RecordingFleet(), slow_source()  # held here: only an explicit close ends it
        task = asyncio.ensure_future(syncer_for(fleet).sync(source, 1))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.sleep(0.1)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert log == [("read", 0), ("source_closed",)]
        assert fleet.log == []  # no engine was touched

    asyncio.run(main())


def test_prefetched_source_yields_everything_once_and_closes_its_source():
    from verst.sync.buckets import PrefetchedSource

    log = []
    source = asyncio.run(PrefetchedSource.read_first(logged_source(log, [[("a", 1)], [("b", 2)]])))
    assert log == [("read", 0)]
    assert list(source) == [[("a", 1)], [("b", 2)]]
    assert list(asyncio.run(PrefetchedSource.read_first([]))) == []
    early = asyncio.run(PrefetchedSource.read_first(logged_source(log, [[("c", 3)]] * 3)))
    early.close()
    assert log[-1] == ("source_closed",) and list(early) == []


def test_versions_only_go_up_and_start_from_the_engines():
    fleet = RecordingFleet(versions={"http://a": "4", "http://b": "6"})
    syncer = syncer_for(fleet)

    async def main():
        for stale in (6, 5):
            with pytest.raises(VersionError, match=f"sync version {stale} but the engines serve version 6"):
                await syncer.sync(BUCKETS, stale)
        assert fleet.log == []  # refused before touching any engine
        await syncer.sync(BUCKETS, 7)
        with pytest.raises(VersionError, match="sync version 7 but the engines serve version 7"):
            await syncer.sync(BUCKETS, 7)
        await syncer.sync(BUCKETS, 9)
        return syncer.version

    assert asyncio.run(main()) == 9


def test_a_non_integer_engine_version_is_refused_naming_the_engine():
    fleet = RecordingFleet(versions={"http://a": "0", "http://b": "base"})
    with pytest.raises(VersionError, match="http://b reports weight_version 'base'"):
        asyncio.run(syncer_for(fleet).sync(BUCKETS, 1))


def test_a_failed_push_continues_every_engine_and_keeps_the_version():
    fleet = RecordingFleet()
    syncer = syncer_for(fleet, error=FleetError("update_weights_from_tensor", {"http://b": RuntimeError("bad shape")}))
    with pytest.raises(WeightSyncError) as info:
        asyncio.run(syncer.sync(BUCKETS, 1))
    message = str(info.value)
    assert "http://b" in message and "bad shape" in message and "Every engine was continued" in message
    assert "still report version 0" in message
    assert actions(fleet.log) == ["pause", "flush_cache", "push", "continue_generation"]
    assert syncer.version == 0  # the next sync may push version 1 again
    syncer.transport.error = None
    asyncio.run(syncer.sync(BUCKETS, 1))
    assert syncer.version == 1


def test_a_partial_pause_still_continues_every_engine():
    fleet = RecordingFleet(fail={"pause": ["http://a"]})
    with pytest.raises(WeightSyncError, match="pause refused.*Every engine was continued"):
        asyncio.run(syncer_for(fleet).sync(BUCKETS, 1))
    assert actions(fleet.log) == ["pause", "continue_generation"]


def test_engines_left_paused_are_named():
    fleet = RecordingFleet(fail={"continue_generation": ["http://b"]})
    with pytest.raises(WeightSyncError, match="loaded on every engine.*may still be PAUSED.*http://b"):
        asyncio.run(syncer_for(fleet).sync(BUCKETS, 1))
    fleet = RecordingFleet(fail={"flush_cache": ["http://a"], "continue_generation": ["http://b"]})
    with pytest.raises(WeightSyncError, match="flush_cache refused.*continue_generation failed too.*PAUSED.*http://b"):
        asyncio.run(syncer_for(fleet).sync(BUCKETS, 1))


def test_cancellation_continues_the_engines_and_is_not_wrapped():
    fleet = RecordingFleet()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(syncer_for(fleet, error=asyncio.CancelledError()).sync(BUCKETS, 1))
    assert actions(fleet.log)[-1] == "continue_generation"


def test_check_runs_once_after_the_first_sync():
    fleet = RecordingFleet()
    calls = []

    class Checker:
        async def check(self, fleet_, version):
            calls.append(version)
            return {"sync/check_max_abs_diff": 0.0}

    syncer = syncer_for(fleet, checker=Checker())
    first = asyncio.run(syncer.sync(BUCKETS, 1))
    second = asyncio.run(syncer.sync(BUCKETS, 2))
    assert calls == [1] and "sync/check_max_abs_diff" in first and "sync/check_max_abs_diff" not in second


def test_interval_and_settings_are_checked():
    fleet = RecordingFleet()
    syncer = syncer_for(fleet, interval=3)
    assert [s for s in range(1, 10) if syncer.due(s)] == [3, 6, 9]
    with pytest.raises(ValueError, match="pause_mode"):
        syncer_for(fleet, mode="sleep")
    with pytest.raises(ValueError, match="interval"):
        syncer_for(fleet, interval=0)


def test_factory_maps_config_and_device_to_transports(tmp_path):
    fleet = RecordingFleet()
    cfg = lambda **kw: SyncConfig(bucket_bytes=2**20, **kw)  # noqa: E731
    dist = build_transport(cfg(transport="distributed"), fleet)
    assert isinstance(dist, DistributedTransport) and dist.backend == "gloo" and dist.bucket_bytes == 2**20
    assert build_transport(cfg(transport="distributed"), fleet, device="cuda").backend == "nccl"
    assert isinstance(build_transport(cfg(transport="tensor"), fleet, device="cuda"), TensorTransport)
    disk = build_transport(cfg(transport="disk"), fleet, snapshot_dir=tmp_path, keep_snapshots=3)
    assert isinstance(disk, DiskTransport) and disk.keep_last == 3
    with pytest.raises(ValueError, match="needs snapshot_dir"):
        build_transport(cfg(transport="disk"), fleet)
    with pytest.raises(ValueError, match="device"):
        build_transport(cfg(transport="tensor"), fleet, device="tpu")
    with pytest.raises(ValueError, match="check_weights = true needs logprobs_fn"):
        build_syncer(cfg(check_weights=True), fleet)
    syncer = build_syncer(cfg(transport="tensor", pause_mode="abort", interval=2), fleet)
    assert syncer.describe() == {"transport": "tensor", "pause_mode": "abort", "interval": 2, "check_weights": False}


def loaded_names(payloads):
    """What each engine would load: its own entries of SGLang's format, read back as an engine reads them."""
    from verst.inference_client.tensor_payload import deserialize_named_tensors

    names = {url: [[name for name, _ in deserialize_named_tensors(entry)] for entry in payloads(url)]
             for url in ("http://a", "http://b")}
    assert names["http://a"] == names["http://b"] and len(names["http://a"]) == 1  # one entry per engine rank
    return names["http://a"][0]


class LoadingFleet(RecordingFleet):
    """Also takes the tensor transport's loads: records each one's version and reads its tensors back."""

    async def update_weights_from_tensor(self, payloads, weight_version, **adapter):
        return await self._all("load", weight_version, loaded_names(payloads), sorted(adapter))


def test_a_transport_with_versioned_loads_flushes_and_versions_with_its_loads():
    # one tensor per piece: three loads, the last of which alone carries the version
    fleet = LoadingFleet()
    transport = TensorTransport(fleet, bucket_bytes=3 * 12)
    three = [[("a", torch.zeros(3)), ("b", torch.ones(3)), ("c", torch.full((3,), 2.0))]]

    async def main():
        try:
            return await WeightSyncer(fleet, transport).sync(three, 4)
        finally:
            await transport.close()

    metrics = asyncio.run(main())
    assert transport.versioned_loads and metrics["sync/buckets"] == 3
    assert fleet.log == [("pause", "retract"), ("load", None, ["a"], []), ("load", None, ["b"], []),
                         ("load", "4", ["c"], []), ("continue_generation",)]


class SlowLoadingFleet(LoadingFleet):
    """Each load takes 0.2 s; logs when it is sent and when it is done."""

    async def update_weights_from_tensor(self, payloads, weight_version, **adapter):
        names = loaded_names(payloads)
        self.log.append(("sent", names[0], weight_version))
        await asyncio.sleep(0.2)
        self.log.append(("done", names[0]))


def test_tensor_loads_are_queued_behind_each_other_and_the_versioned_one_goes_last():
    # a piece's load is sent while the ones before it still run (the engines need not wait a round trip
    # between copies), at most three (each holds a staging buffer); the last load, which sets the version, only once every
    # other is done
    fleet = SlowLoadingFleet()
    transport = TensorTransport(fleet, bucket_bytes=3 * 12)
    five = [[(name, torch.full((3,), float(i))) for i, name in enumerate("abcde")]]

    async def main():
        try:
            await WeightSyncer(fleet, transport).sync(five, 4)
        finally:
            await transport.close()

    asyncio.run(main())
    loads = fleet.log[1:-1]
    assert [entry[1] for entry in loads if entry[0] == "sent"] == list("abcde")
    assert loads.index(("sent", "c", None)) < loads.index(("done", "a"))  # three in flight at once
    in_flight = [sum(1 if e[0] == "sent" else -1 for e in loads[: i + 1]) for i in range(len(loads))]
    assert max(in_flight) == 3
    assert loads[-2:] == [("sent", "e", "4"), ("done", "e")] and in_flight[-3] == 0


def test_pieces_are_at_most_a_third_of_a_bucket_and_piece_bytes(monkeypatch):
    import verst.sync.tensor as tensor_module

    four = [[(name, torch.zeros(2**16)) for name in "abcd"]]  # 256 KiB each

    def pieces(bucket_bytes):
        fleet = LoadingFleet()
        transport = TensorTransport(fleet, bucket_bytes=bucket_bytes)

        async def main():
            try:
                await WeightSyncer(fleet, transport).sync(four, 1)
            finally:
                await transport.close()

        asyncio.run(main())
        return [entry[2] for entry in fleet.log if entry[0] == "load"]

    assert pieces(3 * 2**19) == [["a", "b"], ["c", "d"]]  # thirds of the bucket
    monkeypatch.setattr(tensor_module, "PIECE_BYTES", 2**18)
    assert pieces(3 * 2**19) == [["a"], ["b"], ["c"], ["d"]]


def test_an_adapter_push_leaves_the_flush_and_the_version_to_the_syncer():
    from verst.sync import AdapterSpec

    fleet = LoadingFleet()
    transport = TensorTransport(fleet, bucket_bytes=2**20, adapter=AdapterSpec("policy", {"r": 1}))

    async def main():
        try:
            await WeightSyncer(fleet, transport).sync([[("a", torch.zeros(3))]], 2)
        finally:
            await transport.close()

    asyncio.run(main())
    assert not transport.versioned_loads
    assert actions(fleet.log) == ["pause", "flush_cache", "load", "update_weight_version", "update_weight_version",
                                  "continue_generation"]
    assert fleet.log[2] == ("load", None, ["a"], ["lora_config", "lora_name"])


def test_a_failed_versioned_push_says_engines_may_report_either_version():
    fleet = LoadingFleet(fail={"load": ["http://b"]})
    transport = TensorTransport(fleet, bucket_bytes=2**20)

    async def main():
        try:
            await WeightSyncer(fleet, transport).sync(BUCKETS, 3)
        finally:
            await transport.close()

    with pytest.raises(WeightSyncError, match=r"still report version 0 \(or 3, where their load of the last bucket"):
        asyncio.run(main())
    assert actions(fleet.log) == ["pause", "load", "continue_generation"]


def test_bucket_stream_says_whether_the_bucket_returned_is_the_last():
    from verst.sync.buckets import BucketStream

    async def main():
        stream, seen = BucketStream([[("a", torch.zeros(2))], [("b", torch.zeros(2))]], 8), []
        async for bucket in stream:
            seen.append((bucket[0][0], await stream.at_end()))
        await stream.aclose()
        return seen

    assert asyncio.run(main()) == [("a", False), ("b", True)]
