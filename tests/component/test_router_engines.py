"""Engines behind the real sglang-router on loopback: session affinity by routing key, least-loaded
placement of new sessions, prefix reuse across turns, engines added and removed at run time, a load-based
policy, and weight updates / pause / abort fanned out to every engine directly.

The engines run in this process (`BackgroundServer`); the router is its own process. Each engine's weight
version string is set to its name, so `meta_info.weight_version` tells which engine served a reply.
"""

import asyncio
import time

import pytest
import torch

from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer
from verst.inference_client.client import EngineClient
from verst.inference_client.fleet import EngineFleet
from verst.models.factory import init_model
from verst.models.loader import load_model, load_model_and_tokenizer
from verst.router import RouterManager

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    return {seed: init_model("qwen3", "tiny", root / f"seed{seed}", seed=seed) for seed in (0, 5)}


def start_engine(path):
    model, tokenizer = load_model_and_tokenizer(path)
    return BackgroundServer(EngineCore(model, tokenizer, EngineConfig(max_running_requests=16))).start()


@pytest.fixture(scope="module")
def engines(model_dirs):
    servers = []
    try:
        for _ in range(2):
            servers.append(start_engine(model_dirs[0]))
        yield {"A": servers[0], "B": servers[1]}
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def router(engines):
    with RouterManager([engines["A"].url, engines["B"].url], policy="manual", assignment_mode="min_load") as r:
        yield r


async def label(engines):
    """Name each engine through its weight version; replies then say who served them."""
    async with EngineFleet([e.url for e in engines.values()]) as fleet:
        await asyncio.gather(*(fleet.clients[e.url].update_weight_version(name) for name, e in engines.items()))


def ask(client, key, n=2, prompt=(1, 2, 3)):
    return client.generate(list(prompt), {"max_new_tokens": n, "ignore_eos": True}, routing_key=key)


async def wait_load(url, num_reqs, timeout=20.0):
    async with EngineClient(url) as client:
        deadline = time.monotonic() + timeout
        while (await client.get_load())[0]["num_reqs"] != num_reqs:
            assert time.monotonic() < deadline, f"{url} never reached {num_reqs} requests"
            await asyncio.sleep(0.02)


def test_same_routing_key_lands_on_the_same_engine_over_50_requests(engines, router):
    async def main():
        await label(engines)
        async with EngineClient(router.url, affinity=True) as client:
            results = []
            for batch in range(5):  # 5 rounds of 10 concurrent requests over 5 session keys
                keys = [f"session-{i % 5}" for i in range(10)]
                replies = await asyncio.gather(*(ask(client, k) for k in keys))
                results += list(zip(keys, replies))
            return results

    results = asyncio.run(main())
    assert len(results) == 50
    served = {}
    for key, reply in results:
        served.setdefault(key, set()).add(reply.weight_version)
    assert all(len(where) == 1 for where in served.values()), served


def test_new_keys_land_on_the_less_loaded_engine(engines, router):
    async def main():
        await label(engines)
        async with EngineFleet([e.url for e in engines.values()]) as fleet, EngineClient(router.url) as client:
            await fleet.pause("in_place")  # requests queue up and stay in flight until continue
            try:
                busy = [asyncio.ensure_future(ask(client, "busy")) for _ in range(3)]
                loads = await _loads_when_total(engines, 3)
                busy_engine = next(name for name, n in loads.items() if n == 3)
                fresh = []
                for i in range(2):
                    fresh.append(asyncio.ensure_future(ask(client, f"fresh-{i}")))
                    await _loads_when_total(engines, 4 + i)
            finally:
                await fleet.continue_generation()
            return busy_engine, await asyncio.gather(*busy), await asyncio.gather(*fresh)

    busy_engine, busy, fresh = asyncio.run(main())
    assert {r.weight_version for r in busy} == {busy_engine}
    assert {r.weight_version for r in fresh} == {"A", "B"} - {busy_engine}


async def _loads_when_total(engines, total, timeout=20.0):
    deadline = time.monotonic() + timeout
    async with EngineFleet([e.url for e in engines.values()]) as fleet:
        while True:
            loads = await fleet.each("get_load", lambda c: c.get_load())
            by_name = {name: loads[e.url][0]["num_reqs"] for name, e in engines.items()}
            if sum(by_name.values()) == total:
                return by_name
            assert time.monotonic() < deadline, f"loads {by_name} never summed to {total}"
            await asyncio.sleep(0.02)


def test_second_turn_through_the_router_reuses_its_prefix(engines, router):
    async def main():
        async with EngineClient(router.url, affinity=True) as client:
            first = await client.generate(list(range(60, 100)), {"max_new_tokens": 30, "ignore_eos": True},
                                          routing_key="conversation-1")
            prompt = list(range(60, 100)) + first.output_ids + [10, 72, 105]
            second = await client.generate(prompt, {"max_new_tokens": 5}, routing_key="conversation-1")
            return prompt, second

    prompt, second = asyncio.run(main())
    assert second.cached_tokens >= 0.9 * len(prompt), (second.cached_tokens, len(prompt))


def test_logprobs_through_the_router_match_a_full_forward(engines, router, model_dirs):
    prompts = [[(7 * i + j) % 256 for j in range(12 + i)] for i in range(4)]

    async def main():
        async with router.fleet() as fleet, EngineClient(router.url, affinity=True) as client:
            await fleet.update_weights_from_disk(str(model_dirs[0]), "base")
            params = lambda i: {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": i}  # noqa: E731
            return await asyncio.gather(*(client.generate(p, params(i), routing_key=f"lp-{i}")
                                          for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    model = load_model(model_dirs[0])
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + result.output_ids])).logits[0]
        full = torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : -1]
        expected = full.gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
        assert (expected - torch.tensor(result.logprobs)).abs().max().item() < 1e-4


def test_engines_can_be_added_and_removed_at_run_time(engines, router, model_dirs):
    third = start_engine(model_dirs[0])
    try:
        everyone = {**engines, "C": third}

        async def spread(keys):
            await label(everyone)
            live = {n: e for n, e in everyone.items() if e.url in router.engine_urls}
            async with EngineFleet([e.url for e in live.values()]) as fleet, EngineClient(router.url) as client:
                await fleet.pause("in_place")
                try:
                    tasks = []
                    for i, key in enumerate(keys):
                        tasks.append(asyncio.ensure_future(ask(client, key)))
                        await _loads_when_total(live, i + 1)
                finally:
                    await fleet.continue_generation()
                return {r.weight_version for r in await asyncio.gather(*tasks)}

        router.add_engine(third.url)
        assert third.url in [w["url"] for w in router.workers()]
        assert asyncio.run(spread(["add-1", "add-2", "add-3"])) == {"A", "B", "C"}
        router.remove_engine(third.url)
        assert third.url not in [w["url"] for w in router.workers()]
        assert asyncio.run(spread(["rm-1", "rm-2", "rm-3", "rm-4"])) == {"A", "B"}
    finally:
        if third.url in router.engine_urls:
            router.remove_engine(third.url)
        third.stop()


def test_a_load_based_policy_spreads_single_turn_work(engines):
    async def main():
        await label(engines)
        with RouterManager([e.url for e in engines.values()], policy="round_robin") as rr:
            async with EngineClient(rr.url) as client:
                return await asyncio.gather(*(ask(client, None) for _ in range(10)))

    assert {r.weight_version for r in asyncio.run(main())} == {"A", "B"}


def test_weight_update_pause_and_abort_reach_every_engine_directly(engines, router, model_dirs):
    new_weights = model_dirs[5]
    prompt = [72, 101, 108, 108, 111]

    async def main():
        async with router.fleet() as fleet, EngineClient(router.url, affinity=True) as client:
            await fleet.pause("retract")
            await fleet.update_weights_from_disk(str(new_weights), "v1")
            await fleet.continue_generation()
            versions = await fleet.weight_versions()
            outs = [await client.generate(prompt, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                                          routing_key=f"after-{i}") for i in range(4)]
            long = [asyncio.ensure_future(ask(client, f"long-{i}", n=5000)) for i in range(4)]
            await _loads_when_total(engines, 4)
            await fleet.abort_all()
            aborted = await asyncio.gather(*long)
            return versions, outs, aborted

    versions, outs, aborted = asyncio.run(main())
    assert set(versions.values()) == {"v1"} and len(versions) == 2
    model = load_model(new_weights)
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert all(o.output_ids == hf[0, len(prompt):].tolist() and o.weight_version == "v1" for o in outs)
    assert all(a.finish_reason == "abort" for a in aborted)
