"""The simulated engine and its latency model, on an in-process fleet: continuous batching bounded by the KV
cache, deterministic outputs, pause and versions as the embedded engine has them, faults, and the real weight
syncer against it."""

import asyncio
import contextlib
import time

import pytest

from verst.inference_client.client import EngineClient, EngineError
from verst.inference_client.fleet import EngineFleet
from verst.sim.config import SimConfig
from verst.sim.fleet import FleetSpec, SimFleet
from verst.sim.latency import HARDWARE, EngineCosts, ModelShape
from verst.sim.trainer import SimBackend
from verst.sim.transport import SimTransport
from verst.sync.syncer import WeightSyncer, WeightSyncError

LLAMA_8B = ModelShape(8e9, 8e9, kv_bytes_per_token=131072)


def test_decode_is_memory_bound_at_small_batch_and_compute_bound_at_large():
    costs = EngineCosts(LLAMA_8B, HARDWARE["h100"])
    one = costs.decode_step_s(1, 1000)
    assert one == pytest.approx(0.001 + (16e9 + 131072 * 1000) / (3.35e12 * 0.7), rel=1e-6)  # ~7.9 ms
    assert costs.decode_step_s(64, 64_000) > one  # the batch's KV is read too
    big = costs.decode_step_s(4096, 0)
    assert big == pytest.approx(0.001 + 2 * 8e9 * 4096 / (989e12 * 0.3), rel=1e-6)  # compute bound
    assert costs.prefill_s(1000) == pytest.approx(2 * 8e9 * 1000 / (989e12 * 0.5))
    assert costs.kv_capacity_tokens == int((80e9 - 16e9) * 0.85 / 131072)


def test_a_mixture_of_experts_reads_more_experts_as_the_batch_grows():
    costs = EngineCosts(ModelShape(744e9, 40e9, kv_bytes_per_token=70_000, bytes_per_param=1.0), HARDWARE["gb300"],
                        gpus=8)
    assert costs.weight_bytes_read(1) < 0.1 * 744e9 < costs.weight_bytes_read(64) < 744e9
    with pytest.raises(ValueError, match="leave no KV cache"):
        EngineCosts(ModelShape(744e9, 40e9, kv_bytes_per_token=70_000), HARDWARE["h100"], gpus=8)


def spec(count=2, capacity_gpus=1, speedup=200.0, **over):
    sim = SimConfig(speedup=speedup, response_tokens_mean=40, response_tokens_sigma=0.0)
    costs = sim.engine_costs_inputs() | {"gpus": capacity_gpus}
    return FleetSpec(count=count, costs=costs | over.pop("costs", {}), speedup=speedup, model_path="m",
                     vocab_size=300, response_tokens_mean=40, response_tokens_sigma=0.0, max_running=256,
                     restart_s=0.0, **over)


async def started(fleet_spec):
    fleet = SimFleet(fleet_spec)
    ports = await fleet.start()
    return fleet, [f"http://127.0.0.1:{port}" for port in ports["engines"]]


def test_replies_are_deterministic_per_seed_and_carry_logprobs_and_versions():
    async def main():
        fleet, urls = await started(spec())
        async with EngineClient(urls[0]) as one, EngineClient(urls[1]) as other:
            a = await one.generate([97, 98, 99], {"max_new_tokens": 100, "sampling_seed": 7})
            b = await other.generate([97, 98, 99], {"max_new_tokens": 100, "sampling_seed": 7})
            short = await one.generate([97, 98, 99], {"max_new_tokens": 10, "sampling_seed": 7})
        assert a.output_ids == b.output_ids and len(a.output_ids) == 40 and a.finish_reason == "stop"
        assert len(a.logprobs) == 40 and all(lp <= 0 for lp in a.logprobs)
        assert short.finish_reason == "length" and short.output_ids == a.output_ids[:10]
        assert a.weight_version == a.oldest_weight_version == "0"
        assert all(97 <= t < 123 for t in a.output_ids)  # no special token of a byte tokenizer

    asyncio.run(main())


def test_the_kv_cache_bounds_the_batch_and_queues_the_rest():
    async def main():
        # room for about one request of 1000 prompt + 40 new tokens at a time
        costs = {"kv_memory_fraction": 1.0, "model": {"total_params": 8e9, "active_params": 8e9,
                                                       "kv_bytes_per_token": (80e9 - 16e9) / 1500}}
        fleet, urls = await started(spec(count=1, costs=costs, speedup=1.0))  # a request takes ~0.3 s
        engine = fleet.slots[0].engine
        async with EngineClient(urls[0]) as client:
            calls = [asyncio.ensure_future(client.generate(list(range(97, 97 + 10)) * 100, {"max_new_tokens": 50,
                                                                                           "sampling_seed": i}))
                     for i in range(3)]
            while len(engine.by_rid) < 3:
                await asyncio.sleep(0.005)
            assert (len(engine.running), len(engine.waiting)) == (1, 2)
            results = await asyncio.gather(*calls)
        assert all(len(r.output_ids) == 40 for r in results)
        assert engine.stats()["finished"] == 3

    asyncio.run(main())


def test_a_weight_update_during_a_retracted_request_shows_in_its_versions():
    async def main():
        fleet, urls = await started(spec(count=1, speedup=1.0))  # the request takes ~0.3 s
        engine = fleet.slots[0].engine
        async with EngineClient(urls[0]) as client:
            call = asyncio.ensure_future(client.generate([97] * 8, {"max_new_tokens": 100, "sampling_seed": 1}))
            while not engine.running:
                await asyncio.sleep(0.005)
            await client.pause("retract")
            await client.update_weight_version("1")
            await client.continue_generation()
            result = await call
        assert (result.oldest_weight_version, result.weight_version) == ("0", "1")

    asyncio.run(main())


def test_faults_die_restart_and_refuse_loads_and_the_syncer_names_the_engine():
    async def main():
        fleet, urls = await started(spec(count=3))
        async with EngineFleet(urls) as engines:
            backend = SimBackend(total_params=1e8, bytes_per_param=2.0)
            syncer = WeightSyncer(engines, SimTransport(engines, bucket_bytes=64 * 2**20))
            metrics = await syncer.sync(backend.named_weights(0), 1)
            assert metrics["sync/bytes"] == pytest.approx(2e8, rel=1e-3) and metrics["sync/buckets"] == 4  # 85 a bucket
            assert set((await engines.weight_versions()).values()) == {"1"}
            fleet.slot(1).fault("refuse_loads", 1.0)
            with pytest.raises(WeightSyncError, match=urls[1].split("//")[1]):
                await syncer.sync(backend.named_weights(0), 2)
            fleet.slot(2).fault("die", 1.0)
            with pytest.raises(EngineError, match="no reply"):
                await engines.clients[urls[2]].pause()
            await fleet.slot(2).start(fleet.slot(2).port, "1")  # a restart at the version the others serve
            assert await engines.clients[urls[2]].get_weight_version() == "1"

    asyncio.run(main())


@contextlib.asynccontextmanager
async def one_request_decoding():
    """One engine (speed-up 1) decoding one request of 40 tokens at a batch of one, about 0.3 s: the engine and
    the call."""
    fleet, urls = await started(spec(count=1, speedup=1.0))
    engine = fleet.slots[0].engine
    async with EngineClient(urls[0]) as client:
        call = asyncio.ensure_future(client.generate([97] * 8, {"max_new_tokens": 40, "sampling_seed": 1}))
        while not engine.running:
            await asyncio.sleep(0.005)
        yield engine, call


def test_the_busy_time_read_during_a_decode_counts_it_so_far():
    """A window read while an engine decodes counts what it has decoded so far, not the whole step later."""
    async def main():
        async with one_request_decoding() as (engine, call):
            await asyncio.sleep(0.1)
            during = engine.stats()
            await call
        after = engine.stats()
        assert 0.05 < during["busy_seconds"] < after["busy_seconds"] <= after["uptime_seconds"]
        assert during["batch_seconds"] == pytest.approx(during["busy_seconds"])  # a batch of one

    asyncio.run(main())


def test_a_pause_ends_the_busy_time_of_the_decode_it_interrupts():
    """Busy and paused time never overlap: the decode a pause interrupts is busy until the pause began, even when
    the engine's loop wakes later."""
    async def main():
        async with one_request_decoding() as (engine, call):
            await asyncio.sleep(0.05)
            engine.pause("in_place")
            time.sleep(0.05)  # the loop is busy elsewhere: the decode wakes 50 ms after the pause
            await asyncio.sleep(0.05)
            paused = engine.stats()
            engine.resume()
            await call
        after = engine.stats()
        for counters in (paused, after):
            assert counters["busy_seconds"] + counters["paused_seconds"] <= counters["uptime_seconds"]
        assert paused["paused_seconds"] >= 0.09 and paused["busy_seconds"] > 0.03

    asyncio.run(main())


def test_a_client_that_goes_away_ends_its_request_on_the_engine():
    async def main():
        fleet, urls = await started(spec(count=1, speedup=0.1))  # the request would take seconds
        engine = fleet.slots[0].engine
        async with EngineClient(urls[0]) as client:
            call = asyncio.ensure_future(client.generate([97] * 8, {"max_new_tokens": 100}))
            while not engine.running:
                await asyncio.sleep(0.005)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
        for _ in range(100):
            if not engine.running:
                break
            await asyncio.sleep(0.01)
        assert not engine.running and not engine.by_rid

    asyncio.run(main())


def test_one_request_of_n_samples_seeds_each_as_its_own_request_would_and_aborts_as_one():
    async def main():
        fleet, urls = await started(spec(count=1))
        async with EngineClient(urls[0]) as client:
            prompt, params = [97, 98, 99], {"max_new_tokens": 100, "sampling_seed": 7}
            group = await client.generate_samples(prompt, params, 3, rid="g")
            alone = [await client.generate(prompt, {**params, "sampling_seed": 7 + i}) for i in range(3)]
            unseeded = await client.generate_samples(prompt, {"max_new_tokens": 100}, 3)
            with pytest.raises(EngineError, match="sampling_params.n = 2 is for a single prompt"):
                await client._post("/generate", {"input_ids": [prompt, prompt], "sampling_params": {"n": 2}}, 5.0)
        assert [r.output_ids for r in group] == [r.output_ids for r in alone]
        assert [r.rid for r in group] == ["g_0", "g_1", "g_2"]
        assert len({tuple(r.output_ids) for r in unseeded}) == 3  # distinct samples without a seed too
        slow, urls = await started(spec(count=1, speedup=0.1))  # the samples would take seconds
        engine = slow.slots[0].engine
        async with EngineClient(urls[0]) as client:
            call = asyncio.ensure_future(client.generate_samples([97] * 8, {"max_new_tokens": 100}, 4, rid="h"))
            while len(engine.running) < 4:
                await asyncio.sleep(0.005)
            await client.abort("h")
            aborted = await call
        assert [r.finish_reason for r in aborted] == ["abort"] * 4 and not engine.by_rid

    asyncio.run(main())
