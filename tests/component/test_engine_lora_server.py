"""LoRA adapters over HTTP on `verst serve engine` in a child process: one adapter given at start-up
(--lora-paths), another loaded, replaced and unloaded by name; a batched /generate mixing the base and
both adapters; the OpenAI routes; logprobs equal to transformers + PEFT; unknown names refused."""

import asyncio

import httpx
import pytest
import torch

from tests.lora_adapters import make_adapter, reference_logprobs
from verst.engine.process import EngineProcess
from verst.inference_client.client import EngineClient, EngineError

torch.set_num_threads(1)
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    return {name: (root / name, make_adapter(tiny_model_dir, root / name, seed=seed, **kw))
            for name, seed, kw in (("a", 1, {}), ("b", 2, {"target_modules": ["q_proj", "o_proj"], "r": 2}))}


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapters):
    proc = EngineProcess(tiny_model_dir, entry=["-m", "verst.cli.main", "serve", "engine"],
                         args=["--max-loaded-loras", "2", "--lora-paths", f"a={adapters['a'][0]}"])
    with proc:
        yield proc


def test_adapters_load_serve_batch_and_unload_over_http(engine, adapters):
    async def main():
        async with EngineClient(engine.url) as client:
            loaded = await client.load_lora_adapter("b", str(adapters["b"][0]))
            assert loaded["success"] is True and set(loaded["loaded_adapters"]) == {"a", "b"}
            singles = [await client.generate(PROMPT, SAMPLING, lora_path=name) for name in (None, "a", "b")]
            async with httpx.AsyncClient(base_url=engine.url, timeout=60) as http:
                batch = (await http.post("/generate", json={
                    "input_ids": [PROMPT] * 3, "sampling_params": SAMPLING, "return_logprob": True,
                    "lora_path": [None, "a", "b"]})).json()
                info = (await http.get("/get_server_info")).json()
            await client.unload_lora_adapter("b")
            with pytest.raises(EngineError, match="'b'") as refused:
                await client.generate(PROMPT, SAMPLING, lora_path="b")
            return singles, batch, info, refused.value.status

    singles, batch, info, status = asyncio.run(main())
    assert [r["output_ids"] for r in batch] == [s.output_ids for s in singles]
    assert len({tuple(s.output_ids) for s in singles}) == 3  # each adapter answers differently
    for name, single in zip(("a", "b"), singles[1:]):
        expected = reference_logprobs(adapters[name][1], PROMPT, single.output_ids)
        assert max(abs(x - y) for x, y in zip(expected, single.logprobs)) < 1e-4
    assert [a["lora_name"] for a in info["loaded_loras"]] == ["a", "b"] and info["max_loaded_loras"] == 2
    assert status == 400


def test_openai_routes_take_the_adapter_in_model_and_refuse_an_unknown_one(engine):
    with httpx.Client(base_url=engine.url, timeout=60) as http:
        served = http.get("/v1/models").json()["data"][0]["id"]
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        by_model = http.post("/v1/completions", json={**body, "model": f"{served}:a"}).json()
        by_field = http.post("/v1/completions", json={**body, "lora_path": "a"}).json()
        base = http.post("/v1/completions", json={**body, "model": served}).json()
        native = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": SAMPLING, "lora_path": "a"})
        unknown = http.post("/v1/completions", json={**body, "model": f"{served}:nope"})
    tokens = by_model["choices"][0]["token_ids"]
    assert tokens == by_field["choices"][0]["token_ids"] == native.json()["output_ids"]
    assert tokens != base["choices"][0]["token_ids"]
    assert unknown.status_code == 400 and unknown.json()["error"]["field"] == "lora_path"
    assert "'nope'" in unknown.json()["error"]["message"]
