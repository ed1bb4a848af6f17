"""Contract of the engine HTTP API (SGLang's native dialect): every endpoint answers with SGLang's field
names and shapes, and bad input gets a 4xx naming the field while the engine keeps serving.

Runs the real server over loopback, in this process (`BackgroundServer`), on a tiny MoE model.
"""

import base64
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from tests.lora_adapters import make_adapter
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer
from verst.inference_client.weight_protocol import JOIN_TIMEOUT_S, MAX_WORLD_SIZE
from verst.models.factory import init_model
from verst.models.loader import load_model_and_tokenizer

torch.set_num_threads(1)
CONTEXT = 256


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return init_model("qwen3-moe", "tiny", tmp_path_factory.mktemp("contract") / "moe", seed=0)


@pytest.fixture(scope="module")
def server(moe_dir):
    model, tokenizer = load_model_and_tokenizer(moe_dir)
    core = EngineCore(model, tokenizer, EngineConfig(max_running_requests=8, context_length=CONTEXT))
    with BackgroundServer(core, served_model_name="tiny-moe", model_path=str(moe_dir)) as srv:
        yield srv


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_generate_reply_has_sglang_fields(http):
    body = {"input_ids": [72, 101, 108, 108, 111], "rid": "contract-1", "return_logprob": True,
            "return_routed_experts": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0.7,
                                                               "sampling_seed": 3, "ignore_eos": True}}
    reply = http.post("/generate", json=body).json()
    meta = reply["meta_info"]
    assert set(reply) == {"text", "output_ids", "meta_info"} and isinstance(reply["text"], str)
    assert meta["id"] == "contract-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 6, 0)
    assert meta["weight_version"] == "0" and len(reply["output_ids"]) == 6
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == reply["output_ids"] and all(t[2] is None and t[0] <= 0 for t in triples)
    experts = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    info = http.get("/get_model_info").json()
    assert experts.reshape(5 + 6 - 1, info["moe_layers"], info["moe_top_k"]).max() < 4
    again = http.post("/generate", json={**body, "rid": "contract-2"}).json()
    assert again["output_ids"] == reply["output_ids"]  # same sampling_seed, same tokens
    text = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}).json()
    assert text["meta_info"]["prompt_tokens"] == 5


def test_prefill_scoring_returns_input_token_logprobs_in_sglang_shape(http, moe_dir):
    """max_new_tokens = 0 with logprob_start_len: one prefill, the prompt's logprobs from that position on,
    as `[logprob, token_id, text]` (None at position 0), equal to a full forward's."""
    ids = [72, 101, 108, 108, 111, 33, 7]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 4,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.7}}
    reply = http.post("/generate", json=body).json()
    meta = reply["meta_info"]
    assert reply["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    triples = meta["input_token_logprobs"]
    assert [t[1] for t in triples] == ids[4:] and all(t[2] is None for t in triples)
    model, _ = load_model_and_tokenizer(moe_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double() / 0.7
    want = torch.log_softmax(logits, -1)[3:-1].gather(1, torch.tensor(ids[4:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([t[0] for t in triples], dtype=torch.float64), want, atol=1e-5, rtol=0)
    whole = http.post("/generate", json={**body, "logprob_start_len": 0}).json()["meta_info"]["input_token_logprobs"]
    assert whole[0][0] is None and len(whole) == len(ids)
    assert [t[0] for t in whole[4:]] == pytest.approx([t[0] for t in triples], abs=1e-6)


def test_stream_sends_cumulative_chunks_then_done(http):
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_control_and_info_endpoints(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] and info["weight_version"] == "0"
    server_info = http.get("/get_server_info").json()
    assert server_info["internal_states"][0]["num_running_reqs"] == 0 and server_info["dp_size"] == 1
    load = http.get("/get_load").json()
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}
    assert http.post("/flush_cache").status_code == 200
    assert http.post("/abort_request", json={"rid": "unknown"}).json()["aborted"] == 0
    assert http.post("/pause_generation", json={"mode": "in_place"}).json()["success"] is True
    assert http.post("/continue_generation", json={}).json()["success"] is True
    assert http.post("/update_weight_version", json={"new_version": "0"}).json()["weight_version"] == "0"
    assert http.get("/get_weight_version").json() == {"weight_version": "0"}


def test_openai_compatible_routes_carry_logprobs_and_token_ids(http):
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny-moe"
    completion = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1,
                                                    "return_token_ids": True, "ignore_eos": True}).json()
    choice = completion["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["prompt_token_ids"] == [5, 6, 7]
    assert len(choice["logprobs"]["token_logprobs"]) == 3 and choice["finish_reason"] == "length"
    assert completion["usage"]["total_tokens"] == 6 and completion["metadata"]["weight_version"] == "0"
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
        "return_token_ids": True, "seed": 1}).json()
    choice = chat["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert all(len(item["top_logprobs"]) == 2 for item in choice["logprobs"]["content"])


def test_lora_adapter_endpoints_answer_in_sglang_shapes(http, moe_dir, tmp_path):
    """The MoE model runs transformers' forward: the adapter's deltas join it through module hooks."""
    make_adapter(moe_dir, tmp_path / "adapter", seed=1, target_modules=["q_proj", "v_proj"])
    loaded = http.post("/load_lora_adapter", json={"lora_name": "t", "lora_path": str(tmp_path / "adapter")}).json()
    assert loaded == {"success": True, "error_message": None, "loaded_adapters": {"t": str(tmp_path / "adapter")}}
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    with_adapter = http.post("/generate", json={**body, "lora_path": "t"}).json()
    batch = http.post("/generate", json={**body, "input_ids": [body["input_ids"]] * 2, "lora_path": ["t", None]}).json()
    assert batch[0]["output_ids"] == with_adapter["output_ids"]
    assert batch[1]["output_ids"] == http.post("/generate", json=body).json()["output_ids"]
    listed = http.get("/get_server_info").json()["loaded_loras"]
    assert [(a["lora_name"], a["lora_path"]) for a in listed] == [("t", str(tmp_path / "adapter"))]
    unloaded = http.post("/unload_lora_adapter", json={"lora_name": "t"}).json()
    assert unloaded == {"success": True, "error_message": None, "loaded_adapters": {}}
    refused = http.post("/generate", json={**body, "lora_path": "t"})
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "lora_path"
    failed = http.post("/unload_lora_adapter", json={"lora_name": "t"}).json()
    assert failed["success"] is False and "'t'" in failed["error_message"]


# A join that passes the schema (the engine's state or the peer decide); the cases below break one field each.
GROUP = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
BAD_INPUTS = [
    ("/generate", b'{"input_ids": [1, 2', 422, "body"),
    ("/generate", {"input_ids": "abc"}, 422, "input_ids"),
    ("/generate", {"input_ids": [1, "x"]}, 422, "input_ids.1"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, 422, "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 422, "sampling_params.temperature"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/generate", {"text": ""}, 400, "input_ids"),
    ("/generate", {}, 422, "body"),
    ("/generate", {"input_ids": [1], "text": "a"}, 422, "body"),
    ("/generate", {"input_ids": [1, 265]}, 400, "input_ids"),
    ("/generate", {"input_ids": [-3]}, 400, "input_ids"),
    ("/generate", {"input_ids": list(range(CONTEXT))}, 400, "input_ids"),
    ("/generate", {"input_ids": [1], "unknown_field": 1}, 422, "unknown_field"),
    ("/generate", {"input_ids": [1], "sampling_params": {"unknown": 1}}, 422, "sampling_params.unknown"),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 0}}, 422, "sampling_params.n"),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 2}, "stream": True}, 422, "body"),  # n: one prompt,
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": {"n": 2}}, 422, "body"),  # not streamed, not a batch
    ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, 422, "sampling_params"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [999]}}, 400,
     "sampling_params.stop_token_ids"),
    ("/generate", {"input_ids": [[1], [1, "x"]]}, 422, "input_ids.1.1"),  # a batch
    ("/generate", {"input_ids": [[1], [2]], "rid": ["a"]}, 422, "body"),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}, {"temperature": -1}]}, 422,
     "sampling_params.1.temperature"),
    ("/generate", {"input_ids": [[1], [1, 265]]}, 400, "input_ids"),  # the whole batch is refused
    ("/generate", {"input_ids": [1], "priority": "high"}, 422, "priority"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, 400, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 2], "logprob_start_len": 0}, 400, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -2}, 422, "logprob_start_len"),
    ("/pause_generation", {"mode": "sideways"}, 422, "mode"),
    ("/abort_request", {"rid": 5}, 422, "rid"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/dir"}, 400, "model_path"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["{}"], "load_format": "direct"}, 422, "load_format"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, 400, "serialized_named_tensors"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}, 400, "group_name"),
    ("/generate", {"input_ids": [1], "lora_path": "nope"}, 400, "lora_path"),
    ("/generate", {"input_ids": [1], "lora_path": ""}, 422, "lora_path"),
    ("/generate", {"input_ids": [[1], [2]], "lora_path": [None, "nope"]}, 400, "lora_path"),
    ("/generate", {"input_ids": [[1], [2]], "lora_path": [None]}, 422, "body"),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "lora_path"),
    ("/load_lora_adapter", {"lora_path": "/nonexistent/adapter"}, 422, "lora_name"),
    ("/unload_lora_adapter", {"lora_name": "nope"}, 400, "lora_name"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 422, "body"),
    ("/v1/completions", {"prompt": "hi", "lora_path": "nope"}, 400, "lora_path"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "tiny-moe:nope"}, 400,
     "lora_path"),
    ("/v1/chat/completions", {"messages": []}, 422, "messages"),
    ("/v1/chat/completions", {"messages": [{}]}, 422, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 422, "messages.0.content"),
    ("/v1/completions", {"prompt": [False]}, 422, "prompt.0"),
    ("/v1/completions", {"prompt": [1.5]}, 422, "prompt.0"),
    ("/generate", {"input_ids": [1, True]}, 422, "input_ids.1"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [False]}}, 422,
     "sampling_params.stop_token_ids.0"),
    ("/update_weights_from_disk", {"model_path": "/tmp/nul\u0000byte"}, 400, "model_path"),
    # a pickle naming a function beyond torch's tensor rebuilds (os.system) is refused, never called
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["gASVFAAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOULg=="]}, 400,
     "serialized_named_tensors"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, 422, "shapes.0.0"),
    ("/destroy_weights_update_group", {"group_name": ["x"]}, 422, "group_name"),
    ("/generate", {"input_ids": [1], "stream": 1}, 422, "stream"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": False}}, 422, "sampling_params.temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "2"}}, 422,
     "sampling_params.max_new_tokens"),
    ("/init_weights_update_group", {**GROUP, "backend": "nccl"}, 400, "backend"),
    ("/init_weights_update_group", {**GROUP, "world_size": 104721987922102143257599460633477120}, 422, "world_size"),
    ("/init_weights_update_group", {**GROUP, "world_size": MAX_WORLD_SIZE + 1}, 422, "world_size"),
    ("/init_weights_update_group", {**GROUP, "rank_offset": MAX_WORLD_SIZE}, 422, "rank_offset"),
    ("/init_weights_update_group", {**GROUP, "rank_offset": 2}, 422, "body"),  # rank_offset >= world_size
    ("/init_weights_update_group", {**GROUP, "master_address": "\u00d7\U0010fd5d"}, 422, "master_address"),
    ("/init_weights_update_group", {**GROUP, "master_address": "trainer host"}, 422, "master_address"),
    ("/init_weights_update_group", {**GROUP, "master_address": "a" * 64}, 422, "master_address"),  # a label > 63
    ("/init_weights_update_group", {**GROUP, "master_port": 12574.5}, 422, "master_port"),
    ("/init_weights_update_group", {**GROUP, "master_port": 65536}, 422, "master_port"),
    ("/init_weights_update_group", {**GROUP, "master_port": 0}, 422, "master_port"),
    ("/init_weights_update_group", {**GROUP, "timeout_s": 1e300}, 422, "timeout_s"),
    ("/init_weights_update_group", {**GROUP, "timeout_s": 0}, 422, "timeout_s"),
    ("/v1/chat/completions", {"messages": [{"role": "tool"}]}, 422, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 422, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant",
                                                                                 "tool_calls": []}]}, 422,
     "messages.1.content"),
]


@pytest.mark.parametrize(("path", "body", "status", "field"), BAD_INPUTS,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_4xx_naming_the_field_and_the_engine_keeps_serving(http, path, body, status, field):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"], error
    ok = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] >= 1


def test_integral_floats_are_integers_as_in_json_schema(http):
    body = {"input_ids": [5.0, 6, 7.0], "priority": 1.0, "sampling_params": {"max_new_tokens": 3.0, "n": 1.0,
                                                                              "ignore_eos": True}}
    reply = http.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["prompt_tokens"] == 3 and len(reply.json()["output_ids"]) == 3


def test_unreachable_weight_group_master_is_named_within_the_timeout(http):
    """A master that never answers is the peer's failure (504 naming it and the OS error), reported once
    timeout_s is spent; the engine serves on and no group is registered."""
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "timeout_s": 2}
    start = time.monotonic()
    response = http.post("/init_weights_update_group", json=body)
    assert 2 <= time.monotonic() - start < 2 + 1
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["field"] == "master_address" and error["value"] == f"127.0.0.1:{port}"
    assert f"the group's master (rank 0, the trainer) at 127.0.0.1:{port} did not answer within timeout_s = 2 s " \
           "(ConnectionRefusedError: " in error["message"]
    assert error["message"].endswith("check that the trainer has opened the group at that address and that this "
                                     "engine reaches it, or give a longer timeout_s")
    assert http.get("/health").status_code == 200
    again = http.post("/update_weights_from_distributed", json={"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]})
    assert again.status_code == 400 and again.json()["error"]["field"] == "group_name"


def test_a_master_that_opens_the_group_after_the_request_is_joined(server, http):
    """The trainer may open the group's store a moment after asking the engines to join: the engine keeps
    trying until it listens, then joins as its rank."""
    from verst.inference_client.weights import open_weight_update_group

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    body = {**GROUP, "master_port": port, "group_name": "late-master", "timeout_s": 20}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, f"{server.url}/init_weights_update_group", json=body, timeout=60)
        time.sleep(1.0)
        trainer = open_weight_update_group("127.0.0.1", port, 0, 2, "late-master", "gloo", 20)
        assert reply.result().status_code == 200, reply.result().text
    assert trainer.world_size == 2
    assert http.post("/destroy_weights_update_group", json={"group_name": "late-master"}).status_code == 200


def test_a_master_address_that_does_not_resolve_is_named_at_once(http):
    """A name no resolver knows is the caller's mistake (400), told at once with the resolver's error instead
    of after timeout_s of retries; `.invalid` never resolves (RFC 6761)."""
    body = {**GROUP, "master_address": "verst-no-such-host.invalid", "timeout_s": 20}
    start = time.monotonic()
    response = http.post("/init_weights_update_group", json=body)
    assert time.monotonic() - start < 10
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["field"] == "master_address" and error["value"] == "verst-no-such-host.invalid"
    assert "does not resolve on this engine (gaierror: " in error["message"]
    assert "give the group's master (rank 0, the trainer)'s IP address" in error["message"]


def test_the_join_timeout_defaults_to_the_documented_short_one(http):
    """A join without timeout_s gives up after JOIN_TIMEOUT_S (30 s, docs/engine-api.md), not minutes; the
    published schema says so too."""
    from verst.inference_client.weight_protocol import InitWeightsUpdateGroupRequest

    assert JOIN_TIMEOUT_S <= 30
    assert InitWeightsUpdateGroupRequest.model_validate(GROUP).timeout_s == JOIN_TIMEOUT_S
    schema = http.get("/openapi.json").json()["components"]["schemas"]["InitWeightsUpdateGroupRequest"]
    assert schema["properties"]["timeout_s"]["default"] == JOIN_TIMEOUT_S
    assert schema["properties"]["timeout_s"]["maximum"] == 3600
    assert schema["properties"]["world_size"]["maximum"] == MAX_WORLD_SIZE


def test_chat_to_a_model_without_chat_template_is_refused(tiny_model_dir):
    """A model trained on raw prompts is exported without a template; chat requests get a 400 saying so
    instead of an empty reply rendered through a format it never learnt."""
    from verst.engine.openai_api import NO_CHAT_TEMPLATE

    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    tokenizer.chat_template = None
    core = EngineCore(model, tokenizer, EngineConfig(max_running_requests=2, context_length=CONTEXT))
    with BackgroundServer(core, served_model_name="raw") as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1+2="}]})
        assert reply.status_code == 400
        assert reply.json()["error"] == {"message": NO_CHAT_TEMPLATE, "type": "BadRequestError", "field": "messages",
                                         "value": None, "code": 400}
        completion = http.post("/v1/completions", json={"prompt": "1+2=", "max_tokens": 2})
        assert completion.status_code == 200
