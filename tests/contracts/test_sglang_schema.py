"""verst's SGLang dialect checked against SGLang's own request schema (the facts in `sglang_schema.py`, read
from SGLang 0.5.9's io_struct.py; see there for the commit): the bodies verst's client sends are bodies
SGLang takes (field names and JSON types), and the embedded engine's request models use SGLang's names,
required fields and defaults, with every difference named here and why. Needs no GPU and no SGLang.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.contracts import sglang_schema as sg
from verst.inference_client import protocol as p
from verst.inference_client import weight_protocol as wp
from verst.inference_client.client import EngineClient

MODELS: dict[str, type[p.WireModel]] = {
    "GenerateReqInput": p.GenerateRequest, "UpdateWeightFromDiskReqInput": wp.UpdateWeightsFromDiskRequest,
    "UpdateWeightsFromDistributedReqInput": wp.UpdateWeightsFromDistributedRequest,
    "UpdateWeightsFromTensorReqInput": wp.UpdateWeightsFromTensorRequest,
    "InitWeightsUpdateGroupReqInput": wp.InitWeightsUpdateGroupRequest,
    "DestroyWeightsUpdateGroupReqInput": wp.DestroyWeightsUpdateGroupRequest,
    "UpdateWeightVersionReqInput": wp.UpdateWeightVersionRequest, "PauseGenerationReqInput": p.PauseRequest,
    "AbortReq": p.AbortRequest, "LoadLoRAAdapterReqInput": wp.LoadLoraAdapterRequest,
    "UnloadLoRAAdapterReqInput": wp.UnloadLoraAdapterRequest,
    "ReleaseMemoryOccupationReqInput": wp.MemoryOccupationRequest,
    "ResumeMemoryOccupationReqInput": wp.MemoryOccupationRequest,
}

# Fields the embedded engine takes that this SGLang release does not: verst's extensions.
EXTENSIONS = {
    ("InitWeightsUpdateGroupReqInput", "timeout_s"): "how long to wait for the group's master",
    ("UpdateWeightsFromTensorReqInput", "lora_name"): "an adapter push (AdapterPush)",
    ("UpdateWeightsFromTensorReqInput", "lora_config"): "an adapter push (AdapterPush)",
    ("UpdateWeightsFromDistributedReqInput", "lora_name"): "an adapter push (AdapterPush)",
    ("UpdateWeightsFromDistributedReqInput", "lora_config"): "an adapter push (AdapterPush)",
    ("LoadLoRAAdapterReqInput", "update_in_flight"): "requests in flight move to the new adapter",
    ("GenerateReqInput", "model"): "ignored: OpenAI-style clients and routers add it",
    ("GenerateReqInput", "session_id"): "ignored: a router's bookkeeping hint",
    ("GenerateReqInput", "routed_dp_rank"): "accepted at its default: sglang-router fills it in",
    ("GenerateReqInput", "return_prompt_token_ids"): "accepted at its default: sglang-router fills it in",
}
# SGLang fields the embedded engine refuses (422 naming them), and why.
_INTERNAL = "SGLang-internal (set by its tokenizer manager or HTTP workers, not by clients)"
_DISAGG = "prefill/decode disaggregation, multimodal or tracing: not served by the embedded engine"
_GPU_ONLY = "GPU memory and CUDA-graph controls of SGLang's weight loader"
NOT_TAKEN = {
    "GenerateReqInput": {
        **dict.fromkeys(("http_worker_ipc", "validation_time", "received_time", "received_time_perf"), _INTERNAL),
        **dict.fromkeys(("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
                         "modalities", "need_wait_for_image", "num_items_assigned", "max_dynamic_patch",
                         "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
                         "external_trace_header", "custom_labels"), _DISAGG),
        **dict.fromkeys(("sub_contexts", "sub_context_ids", "sub_context_extra_keys"), "per-block prefix caching"),
        "require_reasoning": "hybrid reasoning models only",
    },
    "UpdateWeightFromDiskReqInput": {
        "rid": _INTERNAL, "http_worker_ipc": _INTERNAL, "manifest": "SGLang's tensor metadata for async loads",
        **dict.fromkeys(("is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph"), _GPU_ONLY),
        "token_step": "SGLang's trainer-step tag; verst tags replies with weight_version",
        "flush_cache": "the embedded engine always flushes its prefix cache after a disk load",
    },
    **{name: {"rid": _INTERNAL, "http_worker_ipc": _INTERNAL} for name in (
        "UpdateWeightsFromDistributedReqInput", "UpdateWeightsFromTensorReqInput", "InitWeightsUpdateGroupReqInput",
        "DestroyWeightsUpdateGroupReqInput", "UpdateWeightVersionReqInput", "PauseGenerationReqInput",
        "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput")},
    "AbortReq": {"http_worker_ipc": _INTERNAL, "finished_reason": _INTERNAL, "abort_message": _INTERNAL},
    "LoadLoRAAdapterReqInput": {"rid": _INTERNAL, "http_worker_ipc": _INTERNAL, "lora_id": _INTERNAL},
    "UnloadLoRAAdapterReqInput": {"rid": _INTERNAL, "http_worker_ipc": _INTERNAL, "lora_id": _INTERNAL},
}
# Defaults that differ on purpose; verst's client always sends these fields, so it never relies on either.
DIVERGENT_DEFAULTS = {
    ("InitWeightsUpdateGroupReqInput", "backend"): "gloo: the embedded engine runs on CPU",
    ("UpdateWeightVersionReqInput", "abort_all_requests"): "False: a version bump alone keeps requests running",
    ("AbortReq", "rid"): "'' (SGLang's __post_init__ turns None into '' too)",
    ("GenerateReqInput", "logprob_start_len"): "None, read as -1 (output logprobs only), SGLang's own default",
    ("GenerateReqInput", "return_logprob"): "False, what SGLang normalizes its None to",
    ("GenerateReqInput", "sampling_params"): "SamplingParams' defaults, what SGLang builds from its None",
}


def taken(model: type[p.WireModel]) -> set[str]:
    return set(model.model_fields) | set(model.accepted_only_at) | set(model.accepted_and_ignored)


def json_types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a property schema admits (`{}`: any)."""
    if "anyOf" in schema:
        return set().union(*(json_types(s) for s in schema["anyOf"]))
    if "enum" in schema:
        return {json_type(v) for v in schema["enum"]}
    if "const" in schema:
        return {json_type(schema["const"])}
    if "$ref" in schema or schema.get("type") == "object" or "additionalProperties" in schema:
        return {"object"}
    kind = schema.get("type")
    return {kind} if kind else {"string", "integer", "number", "boolean", "array", "object", "null"}


def json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}[type(value)]


def admits(sglang_types: Any, kind: str) -> bool:
    allowed = set(sglang_types) if isinstance(sglang_types, tuple) else {sglang_types}
    return kind in allowed or kind == "integer" and "number" in allowed


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_field_is_sglangs_or_a_named_extension(name):
    model, fields = MODELS[name], sg.REQUESTS[name]
    unknown = {f for f in taken(model) - set(fields) if (name, f) not in EXTENSIONS}
    assert not unknown, f"{model.__name__} takes fields SGLang's {name} lacks: {sorted(unknown)}"
    stale = {f for (n, f) in EXTENSIONS if n == name} - taken(model)
    assert not stale, f"listed as extensions but not taken: {sorted(stale)}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_sglang_field_is_taken_or_refused_for_a_named_reason(name):
    missing = set(sg.REQUESTS[name]) - taken(MODELS[name])
    reasons = NOT_TAKEN.get(name, {})
    assert missing == set(reasons), (f"{name}: unclassified {sorted(missing - set(reasons))}; "
                                     f"taken after all {sorted(set(reasons) - missing)}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shared_fields_agree_on_required_defaults_and_types(name):
    model, fields = MODELS[name], sg.REQUESTS[name]
    properties = model.model_json_schema()["properties"]
    for field_name in sorted(set(model.model_fields) & set(fields)):
        kinds, default = fields[field_name]
        info = model.model_fields[field_name]
        assert info.is_required() == (default == sg.REQUIRED), f"{name}.{field_name}: required differs"
        if not info.is_required() and (name, field_name) not in DIVERGENT_DEFAULTS:
            ours = info.get_default(call_default_factory=True)
            ours = ours.model_dump() if hasattr(ours, "model_dump") else ours
            assert ours == default or ours in ([], {}) and default is None, (
                f"{name}.{field_name}: default {ours!r}, SGLang's {default!r}")
        shared = {k for k in json_types(properties[field_name]) if admits(kinds, k)}
        assert shared, f"{name}.{field_name}: no JSON type in common with SGLang's {kinds}"


def test_sampling_params_use_sglang_names_and_defaults():
    fields = sg.SAMPLING_PARAMS
    extra = taken(p.SamplingParams) - set(fields)
    assert not extra, f"sampling params SGLang lacks: {sorted(extra)}"
    for name, info in p.SamplingParams.model_fields.items():
        ours = info.get_default(call_default_factory=True)
        assert ours == fields[name][1] or ours == [] and fields[name][1] is None, name
    assert p.PauseRequest.model_json_schema()["properties"]["mode"]["enum"] == list(sg.PAUSE_MODES)
    tags = wp.MemoryOccupationRequest.model_json_schema()["properties"]["tags"]["anyOf"][0]["items"]["enum"]
    assert tags == list(sg.MEMORY_TAGS)


def captured_client_bodies() -> list[tuple[str, dict[str, Any]]]:
    """Every body verst's EngineClient sends, with its default arguments, over a recording transport."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        sent.append((request.url.path, body))
        if request.url.path == "/generate":
            return httpx.Response(200, json={"text": "", "output_ids": [3], "meta_info": {
                "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 2,
                "completion_tokens": 1, "cached_tokens": 0, "output_token_logprobs": [[-0.5, 3, None]]}})
        return httpx.Response(200, json={"success": True, "message": "", "weight_version": "1"})

    async def drive() -> None:
        async with EngineClient("http://sglang.test", transport=httpx.MockTransport(answer)) as client:
            await client.generate([1, 2], {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                           "min_p": 0.0, "stop": [], "stop_token_ids": [], "ignore_eos": False,
                                           "sampling_seed": 3}, rid="r", return_logprob=True)
            await client.abort("r")
            await client.abort_all()
            for mode in sg.PAUSE_MODES:
                await client.pause(mode)
            await client.continue_generation()
            await client.flush_cache()
            await client.update_weights_from_disk("/ckpt", "1")
            await client.init_weights_update_group("10.0.0.1", 29500, 1, 2, backend="nccl")
            await client.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 2]], "2")
            await client.update_weight_version("3")
            await client.load_lora_adapter("a", "/adapter")
            await client.unload_lora_adapter("a")
            await client.update_weights_from_tensor(["payload"], "4")
            await client.release_memory_occupation()
            await client.resume_memory_occupation(["weights"])

    asyncio.run(drive())
    return sent


def test_client_bodies_are_bodies_sglang_takes():
    sent = captured_client_bodies()
    assert {path for path, _ in sent} >= set(sg.ROUTES) - {"/destroy_weights_update_group"}
    for path, body in sent:
        if path not in sg.ROUTES:
            assert body == {}, f"{path}: SGLang takes no body fields here, verst sent {body}"
            continue
        fields = sg.REQUESTS[sg.ROUTES[path]]
        for key, value in body.items():
            assert key in fields, f"{path}: SGLang's {sg.ROUTES[path]} has no field {key!r}"
            assert admits(fields[key][0], json_type(value)), f"{path}.{key} = {value!r}: SGLang wants {fields[key][0]}"
        missing = {k for k, (_, default) in fields.items() if default == sg.REQUIRED} - set(body)
        assert not missing, f"{path}: required by SGLang, not sent: {sorted(missing)}"
        for key, value in body.get("sampling_params", {}).items():
            assert key in sg.SAMPLING_PARAMS and admits(sg.SAMPLING_PARAMS[key][0], json_type(value)), key
