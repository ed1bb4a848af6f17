"""The engine contract verst relies on, as requests any SGLang-dialect server at a URL must answer the same
way: token ids in and out with logprobs and rid, batches, abort, pause and continue, cache flush, weight
updates from disk with versions, load and info, and bad input refused with a 4xx while serving on.

`VERST_ENGINE_URL=http://host:port` runs it against that server (a real SGLang server in tests/gpu, whose
model must be readable at the path its /get_model_info reports); unset, against the embedded engine on
the tiny model. Reply shapes are checked against SGLang's published ones (`sglang_schema.py`).
"""

from __future__ import annotations

import asyncio
import os
import uuid

import httpx
import pytest

from tests.contracts import sglang_schema as sg
from verst.inference_client.client import EngineClient

PROMPT = [1, 2, 3, 4, 5, 6]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine_url(request):
    url = os.environ.get("VERST_ENGINE_URL")
    if url:
        yield url.rstrip("/")
        return
    import torch

    from verst.engine.core import EngineConfig, EngineCore
    from verst.engine.process import BackgroundServer
    from verst.models.loader import load_model_and_tokenizer

    torch.set_num_threads(1)
    model_dir = request.getfixturevalue("tiny_model_dir")
    model, tokenizer = load_model_and_tokenizer(model_dir)
    core = EngineCore(model, tokenizer, EngineConfig(max_running_requests=8, context_length=256))
    with BackgroundServer(core, served_model_name="tiny", model_path=str(model_dir)) as server:
        yield server.url


def run(engine_url, body):
    async def main():
        async with EngineClient(engine_url) as client:
            return await body(client)

    return asyncio.run(main())


def test_health_info_and_load_in_sglang_shapes(engine_url):
    with httpx.Client(base_url=engine_url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200
        info = http.get("/get_model_info").json()
        assert info["model_path"] and info["is_generation"] is True
        assert isinstance(http.get("/get_server_info").json(), dict)
        load = http.get("/get_load").json()
        assert isinstance(load, list) and load and all(sg.REPLIES["/get_load"] <= set(rank) for rank in load)
        # SGLang 0.5.9 reports the version in /model_info (its /get_weight_version answers 404)
        assert isinstance(http.get("/model_info").json()["weight_version"], str)


def test_generate_token_ids_with_logprobs_and_rid(engine_url):
    async def body(client: EngineClient):
        rid = f"contract-{uuid.uuid4().hex}"
        first = await client.generate(PROMPT, GREEDY, rid=rid, return_logprob=True)
        again = await client.generate(PROMPT, GREEDY, return_logprob=True)
        return rid, first, again

    rid, first, again = run(engine_url, body)
    assert first.rid == rid and first.finish_reason == "length" and len(first.output_ids) == 6
    assert first.prompt_tokens == len(PROMPT) and first.completion_tokens == 6
    assert len(first.logprobs) == 6 and all(lp <= 0 for lp in first.logprobs)
    triples = first.meta_info["output_token_logprobs"]
    assert [t[1] for t in triples] == first.output_ids
    assert again.output_ids == first.output_ids  # greedy: the same tokens


def test_batch_generate_answers_each_prompt_in_order(engine_url):
    """One reply per prompt, in order, each with its own rid (batch invariance of the tokens is not part of
    the contract: GPU kernels may pick other reductions for other batch sizes)."""
    with httpx.Client(base_url=engine_url, timeout=120) as http:
        prompts = [PROMPT, PROMPT[:3], PROMPT[2:]]
        rids = [f"contract-batch-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
        replies = http.post("/generate", json={"input_ids": prompts, "rid": rids, "sampling_params": GREEDY}).json()
    assert [r["meta_info"]["prompt_tokens"] for r in replies] == [6, 3, 4]
    assert [r["meta_info"]["id"] for r in replies] == rids
    assert all(len(r["output_ids"]) == 6 for r in replies)


def test_abort_of_a_queued_request_while_paused(engine_url):
    async def body(client: EngineClient):
        await client.pause("in_place")
        try:
            task = asyncio.ensure_future(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 64}, rid="contract-abort"))
            await asyncio.sleep(0.5)
            await client.abort("contract-abort")
        finally:
            await client.continue_generation()
        return await asyncio.wait_for(task, 60)

    result = run(engine_url, body)
    assert result.finish_reason == "abort" and len(result.output_ids) < 64


@pytest.mark.parametrize("mode", sg.PAUSE_MODES)
def test_pause_then_continue_serves_again(engine_url, mode):
    async def body(client: EngineClient):
        paused = await client.pause(mode)
        resumed = await client.continue_generation()
        return paused, resumed, await client.generate(PROMPT, GREEDY)

    paused, resumed, after = run(engine_url, body)
    assert paused.get("success", True) is not False and resumed.get("success", True) is not False
    assert len(after.output_ids) == 6


def test_weight_update_from_disk_sets_the_version_replies_carry(engine_url):
    version = f"contract-{uuid.uuid4().hex[:8]}"

    async def body(client: EngineClient):
        before = await client.generate(PROMPT, GREEDY)
        path = (await client.get_model_info())["model_path"]
        reply = await client.update_weights_from_disk(path, version)
        await client.flush_cache()
        after = await client.generate(PROMPT, GREEDY)
        return before, reply, await client.get_weight_version(), after

    before, reply, current, after = run(engine_url, body)
    assert reply["success"] is True and sg.REPLIES["/update_weights_from_disk"] <= set(reply)
    assert current == version and after.weight_version == version
    assert after.output_ids == before.output_ids  # the same weights, reloaded


def test_update_weight_version_alone(engine_url):
    async def body(client: EngineClient):
        await client.update_weight_version("contract-v")
        return await client.get_weight_version()

    assert run(engine_url, body) == "contract-v"


@pytest.mark.parametrize("bad", [{"input_ids": "abc"}, {"input_ids": PROMPT, "sampling_params": {"temperature": -1}},
                                 {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}])
def test_bad_generate_gets_a_4xx_and_the_engine_serves_on(engine_url, bad):
    with httpx.Client(base_url=engine_url, timeout=60) as http:
        reply = http.post("/generate", json=bad)
        assert 400 <= reply.status_code < 500, reply.text
        ok = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 6

