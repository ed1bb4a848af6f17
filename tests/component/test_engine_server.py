"""One engine served by `verst serve engine` in a child process, driven over loopback by the async client:
weight updates from disk, shared memory and a gloo broadcast; pause in each mode with requests in
flight; abort one and all; a client that goes away."""

import asyncio
import time

import httpx
import pytest
import torch

from verst.engine.process import EngineProcess
from verst.inference_client.client import EngineClient
from verst.inference_client.ports import free_port
from verst.inference_client.tensor_payload import serialize_named_tensors
from verst.inference_client.weights import broadcast_tensors, dtype_name, open_weight_update_group
from verst.models.factory import init_model
from verst.models.loader import load_model

torch.set_num_threads(1)
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-server")
    return {seed: init_model("qwen3", "tiny", root / f"seed{seed}", seed=seed) for seed in (0, 7, 8, 9)}


@pytest.fixture(scope="module")
def engine(models):
    # started through the CLI entry point, as `verst serve engine --model DIR --port 0` would be
    proc = EngineProcess(models[0], entry=["-m", "verst.cli.main", "serve", "engine"],
                         args=["--max-running-requests", "16"])
    with proc:
        yield proc


def run(coro):
    return asyncio.run(coro)


def greedy_of(model_dir, n=8):
    model = load_model(model_dir)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


async def greedy(client, n=8):
    result = await client.generate(PROMPT, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    return result.output_ids, result.weight_version


def test_weight_update_from_disk(engine, models):
    async def main():
        async with EngineClient(engine.url) as client:
            await client.update_weights_from_disk(str(models[7]), "disk-7")
            assert await client.get_weight_version() == "disk-7"
            return await greedy(client)

    ids, version = run(main())
    assert ids == greedy_of(models[7]) and version == "disk-7"


def test_weight_update_from_tensors_in_shared_memory(engine, models):
    named = list(load_model(models[8]).state_dict().items())

    async def main():
        async with EngineClient(engine.url) as client:
            await client.update_weights_from_tensor([serialize_named_tensors(named)], "tensor-8")
            return await greedy(client)

    ids, version = run(main())
    assert ids == greedy_of(models[8]) and version == "tensor-8"


def test_weight_update_from_a_gloo_broadcast(engine, models):
    named = list(load_model(models[9]).state_dict().items())
    port = free_port()

    async def main():
        async with EngineClient(engine.url) as client:
            # the trainer is rank 0: it joins while the engine joins through HTTP, then broadcasts while
            # the engine receives
            group, _ = await asyncio.gather(
                asyncio.to_thread(open_weight_update_group, "127.0.0.1", port, 0, 2, "wug-test", "gloo", 60.0),
                client.init_weights_update_group("127.0.0.1", port, 1, 2, "wug-test", "gloo"),
            )
            names, tensors = [n for n, _ in named], [t for _, t in named]
            await asyncio.gather(
                asyncio.to_thread(broadcast_tensors, group, tensors),
                client.update_weights_from_distributed(names, [dtype_name(t.dtype) for t in tensors],
                                                       [list(t.shape) for t in tensors], "dist-9", "wug-test"),
            )
            return await greedy(client)

    ids, version = run(main())
    assert ids == greedy_of(models[9]) and version == "dist-9"


LONG = 160


async def launch(client, n, prefix, max_new=LONG):
    params = lambda i: {"max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": 1000 + i}  # noqa: E731
    return [asyncio.ensure_future(client.generate(PROMPT + [i], params(i), rid=f"{prefix}-{i}")) for i in range(n)]


async def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def generated(client):
    return (await client.get_server_info())["internal_states"][0].get("total_generated_tokens", 0)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_with_requests_in_flight_then_continue(engine, mode):
    async def main():
        async with EngineClient(engine.url) as client:
            reference = await asyncio.gather(*await launch(client, 4, f"ref-{mode}"))
            start = await generated(client)
            tasks = await launch(client, 4, f"live-{mode}")
            await wait_until(lambda: _progressed(client, start, 8))
            await client.pause(mode)
            load = (await client.get_load())[0]
            frozen = await generated(client)
            await asyncio.sleep(0.3)
            assert await generated(client) == frozen, "tokens were generated while paused"
            if mode == "abort":
                assert load["num_reqs"] == 0
            elif mode == "retract":
                assert load["num_waiting_reqs"] == 4 and load["num_tokens"] == 0
            else:
                assert load["num_reqs"] == 4 and load["num_waiting_reqs"] == 0 and load["num_tokens"] > 0
            await client.continue_generation()
            return reference, await asyncio.gather(*tasks)

    reference, results = run(main())
    for ref, got in zip(reference, results):
        if mode == "abort":
            assert got.finish_reason == "abort" and got.output_ids == ref.output_ids[: len(got.output_ids)]
            assert len(got.output_ids) < LONG
        else:
            assert got.finish_reason == "length" and got.output_ids == ref.output_ids
            assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) < 1e-4


async def _progressed(client, start, n):
    return await generated(client) - start >= n


def test_abort_one_then_all_over_http(engine):
    async def main():
        async with EngineClient(engine.url) as client:
            start = await generated(client)
            tasks = await launch(client, 3, "abort", max_new=5000)
            await wait_until(lambda: _progressed(client, start, 6))
            await client.abort("abort-1")
            first = await tasks[1]
            assert not tasks[0].done() and not tasks[2].done()
            await client.abort_all()
            rest = await asyncio.gather(tasks[0], tasks[2])
            return first, rest, await client.get_load()

    first, rest, load = run(main())
    assert first.finish_reason == "abort" and first.rid == "abort-1"
    assert all(r.finish_reason == "abort" and 0 < len(r.output_ids) < 5000 for r in rest)
    assert load[0]["num_reqs"] == 0


def test_a_client_that_goes_away_frees_its_request(engine):
    import httpx

    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{engine.url}/generate", json=body, timeout=0.5)

    async def main():
        async with EngineClient(engine.url) as client:
            await wait_until(lambda: _idle(client), timeout=10.0)
            return await client.health_generate()

    assert run(main()) is True


async def _idle(client):
    return (await client.get_load())[0]["num_reqs"] == 0


def test_idle_meter_reads_busy_time_between_reads(engine):
    from verst.inference_client.fleet import EngineFleet, IdleMeter

    async def main():
        async with EngineFleet([engine.url]) as fleet, EngineClient(engine.url) as client:
            meter = IdleMeter(fleet)
            assert await meter.read() is None  # the first read is the baseline
            await asyncio.sleep(0.3)
            quiet = await meter.read()  # nothing ran: (almost) all idle
            busy = await asyncio.gather(*(client.generate(PROMPT, {"max_new_tokens": 64, "ignore_eos": True})
                                          for _ in range(8)))
            loaded = await meter.read()
            info = await client.get_server_info()
            return quiet, loaded, busy, info

    quiet, loaded, busy, info = run(main())
    assert len(busy) == 8 and 0 < info["busy_seconds"] <= info["uptime_seconds"]
    assert quiet > 0.9
    assert 0.0 <= loaded < quiet


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_weight_update_during_a_pause_is_seen_in_the_oldest_version(engine, models, mode):
    """Tokens sampled before the update came from the old weights: the reply says so, and the rollout
    records that oldest version, which is what staleness counts from, then the newest (a mixed-version sample)."""
    from verst.rollout.generate import record_result
    from verst.types import Sample

    async def main():
        async with EngineClient(engine.url) as client:
            await client.update_weights_from_disk(str(models[0]), f"old-{mode}")
            tasks = await launch(client, 2, f"span-{mode}")
            start = await generated(client)
            await wait_until(lambda: _progressed(client, start, 4))
            await client.pause(mode)
            await client.update_weights_from_disk(str(models[8]), f"new-{mode}")
            await client.continue_generation()
            results = await asyncio.gather(*tasks)
            await client.update_weights_from_disk(str(models[0]), "0")
            return results

    for result in run(main()):
        assert result.finish_reason == "length" and len(result.output_ids) == LONG
        assert (result.weight_version, result.oldest_weight_version) == (f"new-{mode}", f"old-{mode}")
        sample = Sample(tokens=list(PROMPT), index=0, group_index=0)
        ctx = type("Ctx", (), {"state": type("State", (), {"observe_version": lambda self, v: None})(),
                               "tokenizer": type("Tok", (), {"decode": lambda self, ids, **kw: ""})(),
                               "routed_experts_top_k": None})()
        record_result(ctx, sample, PROMPT, result)
        assert sample.weight_versions == [f"old-{mode}", f"new-{mode}"]


def test_batched_generate_matches_single_requests_and_isolates_a_bad_prompt(engine):
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:], PROMPT]
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}

    async def main():
        async with EngineClient(engine.url) as single, EngineClient(engine.url, max_batch=8) as batched:
            alone = [await single.generate(ids, {**params, "sampling_seed": i}, rid=f"one{i}")
                     for i, ids in enumerate(prompts)]
            together = await asyncio.gather(*(batched.generate(ids, {**params, "sampling_seed": i}, rid=f"bat{i}")
                                              for i, ids in enumerate(prompts)))
            mixed = await asyncio.gather(batched.generate(PROMPT, params), batched.generate([10**6], params),
                                         return_exceptions=True)
            return alone, together, mixed, batched._batcher.requests_sent

    alone, together, (good, bad), requests = asyncio.run(main())
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    for a, b in zip(together, alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [r.rid for r in together] == [f"bat{i}" for i in range(4)]
    assert len(good.output_ids) == 6 and bad.status == 400 and "input_ids" in str(bad)
    assert requests == 1 + 1 + 2  # one batch of four; then a batch of two refused and retried one by one


def test_one_request_of_n_samples_matches_n_seeded_requests_and_aborts_as_one(engine):
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 40}

    async def main():
        async with EngineClient(engine.url) as client:
            alone = [await client.generate(PROMPT, {**params, "sampling_seed": 40 + i}) for i in range(3)]
            group = await client.generate_samples(PROMPT, params, 3, rid="grp")
            start = await generated(client)
            long = asyncio.ensure_future(client.generate_samples(
                PROMPT, {"max_new_tokens": 5000, "ignore_eos": True}, 3, rid="long"))
            await wait_until(lambda: _progressed(client, start, 9))
            await client.abort("long")
            return alone, group, await long, await client.get_load()

    alone, group, aborted, load = run(main())
    assert [r.output_ids for r in group] == [r.output_ids for r in alone]
    for a, b in zip(group, alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [r.rid for r in group] == ["grp_0", "grp_1", "grp_2"]
    assert len({tuple(r.output_ids) for r in group}) > 1  # three samples, not one thrice
    assert [r.finish_reason for r in aborted] == ["abort"] * 3 and all(0 < len(r.output_ids) < 5000 for r in aborted)
    assert load[0]["num_reqs"] == 0


def test_a_body_that_is_not_json_is_refused_naming_the_body(engine):
    replies = [httpx.post(f"{engine.url}/generate", content=body, headers={"content-type": "application/json"})
               for body in (b'{"input_ids": [1, 2', b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}')]
    for reply in replies:
        assert reply.status_code == 422, reply.text
        (error,) = reply.json()["detail"]
        assert error["type"] == "json_invalid" and error["loc"] == ["body", 0]
