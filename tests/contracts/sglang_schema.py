"""SGLang's published request and reply shapes, as data: field name -> (JSON type, default or REQUIRED).

Read from SGLang's source, release line 0.5.9: `python/sglang/srt/managers/io_struct.py` as mirrored in
github.com/40349/sglang-v.0.5.9 at commit 00041e51828f3ea480ad834e093ba58447eebeae (the dataclasses
GenerateReqInput, UpdateWeightFromDiskReqInput, UpdateWeightsFromDistributedReqInput,
UpdateWeightsFromTensorReqInput, InitWeightsUpdateGroupReqInput, DestroyWeightsUpdateGroupReqInput,
UpdateWeightVersionReqInput, PauseGenerationReqInput, AbortReq, LoadLoRAAdapterReqInput,
UnloadLoRAAdapterReqInput, ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput and their outputs), and the arguments of `SamplingParams.__init__` in
`python/sglang/srt/sampling/sampling_params.py` of the same line. Every request dataclass also takes
BaseReq's keyword fields `rid` and `http_worker_ipc`.
"""

from __future__ import annotations

REQUIRED = "required"
STR, INT, BOOL, OBJ, LIST, NUM = "string", "integer", "boolean", "object", "array", "number"

BASE_REQ = {"rid": ((STR, LIST, "null"), None), "http_worker_ipc": ((STR, "null"), None)}

SAMPLING_PARAMS = {
    "max_new_tokens": ((INT, "null"), 128), "stop": ((STR, LIST, "null"), None),
    "stop_token_ids": ((LIST, "null"), None), "stop_regex": ((STR, LIST, "null"), None),
    "temperature": (NUM, 1.0), "top_p": (NUM, 1.0), "top_k": (INT, -1), "min_p": (NUM, 0.0),
    "frequency_penalty": (NUM, 0.0), "presence_penalty": (NUM, 0.0), "repetition_penalty": (NUM, 1.0),
    "min_new_tokens": (INT, 0), "n": (INT, 1), "json_schema": ((STR, "null"), None), "regex": ((STR, "null"), None),
    "ebnf": ((STR, "null"), None), "structural_tag": ((STR, "null"), None), "ignore_eos": (BOOL, False),
    "skip_special_tokens": (BOOL, True), "spaces_between_special_tokens": (BOOL, True),
    "no_stop_trim": (BOOL, False), "custom_params": ((OBJ, "null"), None), "stream_interval": ((INT, "null"), None),
    "logit_bias": ((OBJ, "null"), None), "sampling_seed": ((INT, "null"), None),
}

_OPT_STR, _OPT_INT, _OPT_OBJ, _OPT_LIST = (STR, "null"), (INT, "null"), (OBJ, "null"), (LIST, "null")
GENERATE = {
    **BASE_REQ,
    "text": ((STR, LIST, "null"), None), "input_ids": (_OPT_LIST, None), "input_embeds": (_OPT_LIST, None),
    "image_data": ((STR, LIST, OBJ, "null"), None), "video_data": ((STR, LIST, OBJ, "null"), None),
    "audio_data": ((STR, LIST, OBJ, "null"), None), "sampling_params": ((OBJ, LIST, "null"), None),
    "return_logprob": ((BOOL, LIST, "null"), None), "logprob_start_len": ((INT, LIST, "null"), None),
    "top_logprobs_num": ((INT, LIST, "null"), None), "token_ids_logprob": (_OPT_LIST, None),
    "return_text_in_logprobs": (BOOL, False), "stream": (BOOL, False), "log_metrics": (BOOL, True),
    "return_hidden_states": ((BOOL, LIST), False), "return_routed_experts": (BOOL, False),
    "routed_experts_start_len": (INT, 0), "modalities": (_OPT_LIST, None), "session_params": ((OBJ, LIST, "null"), None),
    "lora_path": ((STR, LIST, "null"), None), "lora_id": ((STR, LIST, "null"), None),
    "custom_logit_processor": ((STR, LIST, "null"), None), "bootstrap_host": ((STR, LIST, "null"), None),
    "bootstrap_port": ((INT, LIST, "null"), None), "bootstrap_room": ((INT, LIST, "null"), None),
    "bootstrap_pair_key": ((STR, LIST, "null"), None), "decode_tp_size": ((INT, LIST, "null"), None),
    "require_reasoning": (BOOL, False), "data_parallel_rank": (_OPT_INT, None), "background": (BOOL, False),
    "conversation_id": (_OPT_STR, None), "priority": (_OPT_INT, None), "extra_key": ((STR, LIST, "null"), None),
    "sub_contexts": (_OPT_LIST, None), "sub_context_ids": (_OPT_LIST, None), "sub_context_extra_keys": (_OPT_LIST, None),
    "routing_key": (_OPT_STR, None), "no_logs": (BOOL, False), "custom_labels": (_OPT_OBJ, None),
    "return_bytes": (BOOL, False), "return_entropy": (BOOL, False), "external_trace_header": (_OPT_OBJ, None),
    "need_wait_for_image": ((BOOL, "null"), None), "num_items_assigned": (_OPT_LIST, None),
    "max_dynamic_patch": (_OPT_INT, None), "min_dynamic_patch": (_OPT_INT, None),
    "image_max_dynamic_patch": (_OPT_INT, None), "video_max_dynamic_patch": (_OPT_INT, None),
    "validation_time": ((NUM, "null"), None), "received_time": ((NUM, "null"), None),
    "received_time_perf": ((NUM, "null"), None),
}

REQUESTS: dict[str, dict[str, tuple]] = {
    "GenerateReqInput": GENERATE,
    "UpdateWeightFromDiskReqInput": {
        **BASE_REQ, "model_path": (STR, REQUIRED), "load_format": (_OPT_STR, None), "abort_all_requests": (BOOL, False),
        "weight_version": (_OPT_STR, None), "is_async": (BOOL, False), "torch_empty_cache": (BOOL, False),
        "keep_pause": (BOOL, False), "recapture_cuda_graph": (BOOL, False), "token_step": (INT, 0),
        "flush_cache": (BOOL, True), "manifest": (_OPT_OBJ, None),
    },
    "UpdateWeightsFromDistributedReqInput": {
        **BASE_REQ, "names": (LIST, REQUIRED), "dtypes": (LIST, REQUIRED), "shapes": (LIST, REQUIRED),
        "group_name": (STR, "weight_update_group"), "flush_cache": (BOOL, True), "abort_all_requests": (BOOL, False),
        "weight_version": (_OPT_STR, None), "load_format": (_OPT_STR, None),
    },
    "UpdateWeightsFromTensorReqInput": {
        **BASE_REQ, "serialized_named_tensors": (LIST, REQUIRED), "load_format": (_OPT_STR, None),
        "flush_cache": (BOOL, True), "abort_all_requests": (BOOL, False), "weight_version": (_OPT_STR, None),
    },
    "InitWeightsUpdateGroupReqInput": {
        **BASE_REQ, "master_address": (STR, REQUIRED), "master_port": (INT, REQUIRED), "rank_offset": (INT, REQUIRED),
        "world_size": (INT, REQUIRED), "group_name": (STR, "weight_update_group"), "backend": (STR, "nccl"),
    },
    "DestroyWeightsUpdateGroupReqInput": {**BASE_REQ, "group_name": (STR, "weight_update_group")},
    "UpdateWeightVersionReqInput": {**BASE_REQ, "new_version": (STR, REQUIRED), "abort_all_requests": (BOOL, True)},
    "PauseGenerationReqInput": {**BASE_REQ, "mode": (STR, "abort")},
    "AbortReq": {**BASE_REQ, "abort_all": (BOOL, False), "finished_reason": (_OPT_OBJ, None),
                 "abort_message": (_OPT_STR, None)},
    "LoadLoRAAdapterReqInput": {**BASE_REQ, "lora_name": (STR, REQUIRED), "lora_path": (STR, REQUIRED),
                                "pinned": (BOOL, False), "lora_id": (_OPT_STR, None)},
    "UnloadLoRAAdapterReqInput": {**BASE_REQ, "lora_name": (STR, REQUIRED), "lora_id": (_OPT_STR, None)},
    # `tags`: "Currently we only support `weights` and `kv_cache`" (io_struct.py's comment)
    "ReleaseMemoryOccupationReqInput": {**BASE_REQ, "tags": (_OPT_LIST, None)},
    "ResumeMemoryOccupationReqInput": {**BASE_REQ, "tags": (_OPT_LIST, None)},
}
MEMORY_TAGS = ("weights", "kv_cache")
PAUSE_MODES = ("abort", "retract", "in_place")  # PauseGenerationReqInput.mode's Literal

# The HTTP route of each request, as SGLang's http_server serves it.
ROUTES = {
    "/generate": "GenerateReqInput", "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput", "/pause_generation": "PauseGenerationReqInput",
    "/abort_request": "AbortReq", "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}

# Reply dataclasses: the fields every reply of that route carries.
REPLIES = {
    "/update_weights_from_disk": {"success", "message", "num_paused_requests"},  # UpdateWeightFromDiskReqOutput
    "/init_weights_update_group": {"success", "message"},  # InitWeightsUpdateGroupReqOutput
    "/update_weights_from_distributed": {"success", "message"},  # UpdateWeightsFromDistributedReqOutput
    "/update_weights_from_tensor": {"success", "message"},  # UpdateWeightsFromTensorReqOutput
    "/load_lora_adapter": {"success", "error_message", "loaded_adapters"},  # LoRAUpdateOutput
    "/unload_lora_adapter": {"success", "error_message", "loaded_adapters"},
    "/get_load": {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"},  # GetLoadReqOutput, per rank
}

# How SGLang unpickles `serialized_named_tensors` (`MultiprocessingSerializer.deserialize`, its `SafeUnpickler`
# in python/sglang/srt/utils/common.py, the allowlist against CVE-2025-10164): a global resolves only when its
# module, with a dot appended, starts with one of these prefixes, and never when it is one of the denied pairs.
UNPICKLE_MODULE_PREFIXES = (
    "builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.", "weakref.",
    "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.", "pickletools.", "peft.",
    "transformers.", "huggingface_hub.", "sglang.srt.weight_sync.tensor_bucket.",
    "sglang.srt.model_executor.model_runner.", "sglang.srt.layers.", "sglang.srt.utils.",
)
UNPICKLE_DENIED = {
    ("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"), ("os", "system"), ("subprocess", "Popen"),
    ("subprocess", "run"), ("codecs", "decode"), ("types", "CodeType"), ("types", "FunctionType"),
}
