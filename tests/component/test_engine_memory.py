"""Releasing and resuming an engine's memory (SGLang's `/release_memory_occupation`, `/resume_memory_occupation`)
on a real engine process: after a release the process's resident memory falls by at least the KV pool it held
(the slot storage of running requests; the prefix cache's copies go too), requests and weight loads are
refused by name while released, and after a resume the engine generates the same tokens for the same seeds."""

import asyncio

import pytest

from verst.engine.process import EngineProcess
from verst.inference_client.client import EngineClient, EngineError
from verst.inference_client.tensor_payload import serialize_named_tensors
from verst.models.factory import init_model
from verst.models.loader import load_model

PROMPTS = [[(7 * i + j) % 200 + 20 for j in range(96)] for i in range(48)]  # distinct: each gets its own KV
SAMPLING = {"temperature": 1.0, "max_new_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("memory") / "tiny-qwen3", seed=3)


@pytest.fixture(scope="module")
def engine(model_path):
    server = EngineProcess(model_path, args=["--max-running-requests", "48"]).start()
    try:
        yield server
    finally:
        server.stop()


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


async def seeded(client: EngineClient) -> list[list[int]]:
    replies = await asyncio.gather(*(client.generate(p, {**SAMPLING, "sampling_seed": i}) for i, p in enumerate(PROMPTS)))
    return [r.output_ids for r in replies]


def test_release_frees_the_kv_pool_and_resume_generates_the_same_tokens(engine):
    async def main():
        async with EngineClient(engine.url) as client:
            before = await seeded(client)
            state = (await client.get_server_info())["internal_states"][0]
            rss_held = resident_bytes(engine.proc.pid)
            reply = await client.release_memory_occupation()
            rss_released = resident_bytes(engine.proc.pid)
            with pytest.raises(EngineError, match="released by /release_memory_occupation") as refused:
                await client.generate(PROMPTS[0], SAMPLING)
            released_state = (await client.get_server_info())["internal_states"][0]
            await client.resume_memory_occupation()
            after = await seeded(client)
            return before, after, state, rss_held - rss_released, reply, refused.value, released_state

    before, after, state, drop, reply, refused, released_state = asyncio.run(main())
    pool, cached = state["kv_cache_bytes"], state["prefix_cache_bytes"]
    print(f"KV pool {pool} bytes, prefix cache {cached} bytes; resident memory fell by {drop} bytes")
    assert pool > 16 * 2**20  # a pool big enough that the drop is not noise
    assert reply["freed_bytes"] == {"kv_cache": pool + cached, "weights": 0}  # CPU: the weights stay
    # the pool's large tensors go back whole; the prefix cache's small copies as far as the allocator's pages allow
    assert drop >= pool
    assert refused.status == 400 and refused.field == "tags"
    assert released_state["released_memory"] == ["kv_cache", "weights"] and released_state["kv_cache_bytes"] == 0
    assert after == before


def test_release_and_resume_refuse_what_they_cannot_do(engine, model_path):
    named = list(load_model(model_path).state_dict().items())[:1]

    async def main():
        async with EngineClient(engine.url) as client:
            await client.release_memory_occupation(["weights"])
            errors = {}
            for name, call in (
                ("release twice", client.release_memory_occupation(["weights"])),
                ("load while released", client.update_weights_from_tensor([serialize_named_tensors(named)], "9")),
                ("resume what is not released", client.resume_memory_occupation(["kv_cache"])),
                ("unknown tag", client.release_memory_occupation(["cuda_graph"])),
            ):
                with pytest.raises(EngineError) as info:
                    await call
                errors[name] = info.value
            await client.resume_memory_occupation(["weights"])
            served = await client.generate(PROMPTS[0], {**SAMPLING, "max_new_tokens": 2})
            return errors, served

    errors, served = asyncio.run(main())
    assert "released already" in str(errors["release twice"])
    assert "a weight load needs the engine's memory" in str(errors["load while released"])
    assert "not released" in str(errors["resume what is not released"])
    assert errors["unknown tag"].status == 422 and "tags" in str(errors["unknown tag"])
    assert all(e.field is not None and e.field.startswith("tags") for e in errors.values())
    assert len(served.output_ids) == 2
