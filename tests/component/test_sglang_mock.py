"""verst against the SGLang mock (`tests/sglang_mock.py`), started as verst starts SGLang (the launcher
execs `python -m sglang.launch_server`): every request verst sends passes SGLang 0.5.9's request schema and
every reply in SGLang's shapes reads right. Health, generation with real logprobs, pause and continue, the
three weight-load routes through verst's syncer, memory release and resume, LoRA load and unload, routed
experts; and the mock refuses what SGLang would not take."""

import asyncio
import json

import httpx
import pytest
import torch
import torch.distributed as dist

from tests.component.test_sync_transports import BUCKET, assert_serves, greedy, train_step
from tests.lora_adapters import make_adapter, reference_logprobs
from tests.moe_models import near_tie_moe
from tests.sglang_mock import LOG_ENV, mock_sglang_python
from verst.config.schema import ModelConfig, SyncConfig, TrainerConfig
from verst.engine.process import EngineProcess
from verst.inference_client.client import EngineClient, EngineError
from verst.inference_client.fleet import EngineFleet
from verst.models.factory import init_model
from verst.sync import build_syncer
from verst.trainer import FSDP2Backend

LAUNCHER = ["-m", "verst.engine_kinds.sglang_launcher"]


def start_mock(model, tmp_path, flags=(), log=None):
    """The mock behind verst's SGLang launcher, as an engine actor starts it."""
    args = ["--engine-python", mock_sglang_python(tmp_path / "mock"), "--dtype", "float32", "--device", "cpu",
            "--engine-flags", json.dumps(list(flags)), "--weight-version", "0"]
    env = {LOG_ENV: str(log)} if log else None
    return EngineProcess(model, entry=LAUNCHER, args=args, env=env).start()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("sglang-mock") / "tiny-qwen3", seed=5)


@pytest.fixture(scope="module")
def mock(model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mock")
    log = tmp / "requests.jsonl"
    server = start_mock(model_path, tmp, ["--enable-memory-saver"], log)
    try:
        yield server, log
    finally:
        server.stop()


@pytest.fixture(scope="module")
def trainer(model_path):
    backend = FSDP2Backend(ModelConfig(path=str(model_path)), TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=256),
                           device="cpu")
    yield backend
    if dist.is_initialized():
        dist.destroy_process_group()


def requests_seen(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_three_weight_loads_pause_and_continue_through_verst_syncer(mock, trainer, model_path, tmp_path):
    server, log = mock

    async def main(transport):
        async with EngineFleet([server.url]) as fleet:
            syncer = build_syncer(SyncConfig(transport=transport, bucket_bytes=BUCKET), fleet,
                                  snapshot_dir=tmp_path / "snapshots", source_model=model_path)
            version = await syncer.current_version() + 1
            train_step(trainer, seed=version)
            await syncer.sync(trainer.named_weights(BUCKET), version)
            await syncer.close()
            return await greedy(fleet), version

    for transport in ("tensor", "distributed", "disk"):
        results, version = asyncio.run(main(transport))
        assert_serves(trainer, model_path, results, version)  # greedy ids and logprobs of the trainer's weights
    paths = {entry["path"] for entry in requests_seen(log)}
    assert {"/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed",
            "/update_weights_from_disk", "/pause_generation", "/continue_generation", "/model_info"} <= paths


def test_memory_release_and_resume_and_health(mock):
    server, _ = mock

    async def main():
        async with EngineClient(server.url) as client:
            healthy = await client.health() and await client.health_generate()
            released = await client.release_memory_occupation()
            with pytest.raises(EngineError) as refused:
                await client.generate([1, 2, 3], {"max_new_tokens": 2})
            resumed = await client.resume_memory_occupation()
            served = await client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0})
            return healthy, released, resumed, refused.value, served

    healthy, released, resumed, refused, served = asyncio.run(main())
    assert healthy and released is None and resumed is None  # SGLang answers null
    assert refused.status == 400 and "released by /release_memory_occupation" in str(refused)
    assert len(served.output_ids) == 2


def test_lora_adapters_load_serve_and_unload(model_path, tmp_path):
    # a mock of its own: the shared one serves trained weights by now, and the reference is the adapter on the base
    adapter = make_adapter(model_path, tmp_path / "adapter", seed=1)
    prompt = [5, 6, 7, 8]
    server = start_mock(model_path, tmp_path, ["--enable-lora"])

    async def main():
        async with EngineClient(server.url) as client:
            loaded = await client.load_lora_adapter("a", str(tmp_path / "adapter"))
            reply = await client.generate(prompt, {"max_new_tokens": 3, "temperature": 0}, return_logprob=True,
                                          lora_path="a")
            unloaded = await client.unload_lora_adapter("a")
            with pytest.raises(EngineError) as gone:
                await client.generate(prompt, {"max_new_tokens": 1}, lora_path="a")
            return loaded, reply, unloaded, gone.value

    try:
        loaded, reply, unloaded, gone = asyncio.run(main())
    finally:
        server.stop()
    assert loaded["success"] and "a" in loaded["loaded_adapters"] and "a" not in unloaded["loaded_adapters"]
    torch.testing.assert_close(torch.tensor(reply.logprobs),
                               torch.tensor(reference_logprobs(adapter, prompt, reply.output_ids)), atol=1e-4, rtol=0)
    assert gone.status == 400


def test_routed_experts_come_back_in_sglangs_layout(tmp_path):
    moe = near_tie_moe(tmp_path / "moe")
    server = start_mock(moe, tmp_path, ["--enable-return-routed-experts"])
    try:
        async def main():
            async with EngineClient(server.url) as client:
                return await client.generate([3, 4, 5, 6], {"max_new_tokens": 4}, return_routed_experts=True)

        reply = asyncio.run(main())
    finally:
        server.stop()
    experts = reply.routed_experts(top_k=2)
    assert experts.shape == (4 + 4 - 1, 2, 2)  # every token but the last, per MoE layer, top-k


@pytest.mark.parametrize("path, body, says", [
    ("/generate", {"input_ids": [1], "not_a_field": 1}, "SGLang has no field(s) ['not_a_field']"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}}, "has no field(s) ['max_tokens']"),
    ("/update_weights_from_disk", {"model_path": 3}, "model_path = 3 is integer"),
    ("/update_weights_from_tensor", {}, "missing required field(s) ['serialized_named_tensors']"),
    ("/pause_generation", {"mode": "sideways"}, "mode = 'sideways'"),
    ("/release_memory_occupation", {"tags": ["cuda_graph"]}, "tags ['cuda_graph']"),
])
def test_the_mock_refuses_what_sglang_would_not_take(mock, path, body, says):
    server, _ = mock
    reply = httpx.post(server.url + path, json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["object"] == "error" and says in reply.json()["message"]


def test_sglang_answers_get_weight_version_with_a_404_and_blocks_foreign_pickles(mock):
    server, _ = mock
    assert httpx.get(server.url + "/get_weight_version", timeout=30).status_code == 404
    evil = "gASVFAAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOULg=="  # pickle of os.system
    reply = httpx.post(server.url + "/update_weights_from_tensor", json={"serialized_named_tensors": [evil]}, timeout=30)
    assert reply.status_code == 400 and "SGLang blocks unpickling posix.system" in reply.json()["message"]
