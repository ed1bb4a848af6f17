"""What the HTTP routes share: the served engine's state, wire-to-engine request translation, and waiting
for a result while watching for the client going away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse

from verst.engine.request import Request
from verst.engine.runner import EngineRunner
from verst.inference_client.protocol import InvalidRequest, SamplingParams

DISCONNECT_POLL_S = 1.0


@dataclasses.dataclass
class ServerState:
    runner: EngineRunner
    tokenizer: Any
    model_path: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 0
    weight_groups: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def core(self):
        return self.runner.core

    @property
    def on_cuda(self) -> bool:
        """Whether the engine serves on a CUDA device (the NCCL weight broadcast needs that); its weights may be
        in host memory for a while (`memory.py`)."""
        return self.core.runner.device.type == "cuda"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        return self.decode([token], skip_special_tokens=False)

    def encode(self, text: str, field: str = "text") -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest(field, text, "this engine has no tokenizer; send input_ids")
        return list(self.tokenizer.encode(text))


def build_request(
    state: ServerState, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None,
    return_logprob: bool = False, top_logprobs_num: int = 0, return_routed_experts: bool = False,
    priority: int = 0, lora_path: str | None = None, logprob_start_len: int | None = None,
) -> Request:
    """An engine request from wire values, validated against the model (vocabulary, context, MoE) and
    the loaded LoRA adapters (an unknown name is refused here, before a stream's headers go out)."""
    core = state.core
    if return_routed_experts and not core.runner.moe_layers:
        raise InvalidRequest("return_routed_experts", True, "the served model has no MoE router")
    start = -1 if logprob_start_len is None else logprob_start_len
    if start >= 0 and not return_logprob:
        raise InvalidRequest("logprob_start_len", start, "prompt logprobs need return_logprob = true")
    if start >= len(input_ids):
        raise InvalidRequest("logprob_start_len", start, f"must be below the prompt length ({len(input_ids)} tokens)")
    if start >= 0 and lora_path is not None:
        raise InvalidRequest("logprob_start_len", start, "prompt logprobs are computed by the base model; "
                             "this request names LoRA adapter " + repr(lora_path))
    always_experts = core.config.return_routed_experts and bool(core.runner.moe_layers)
    req = Request(
        rid=rid or uuid.uuid4().hex, prompt_ids=input_ids, sampling=sampling, return_logprob=return_logprob,
        logprob_start_len=start, top_logprobs_num=top_logprobs_num, return_routed_experts=return_routed_experts or always_experts,
        priority=priority, lora_path=lora_path, lora=core.loras.get(lora_path),
    )
    core.validate(req)
    return req


async def run_to_completion(
    state: ServerState, req: Request, is_disconnected: Callable[[], Awaitable[bool]] | None
) -> Request | None:
    """Generate `req`; None when the client disconnected first (the request is then aborted)."""
    done = await run_all_to_completion(state, [req], is_disconnected)
    return None if done is None else done[0]


async def run_all_to_completion(
    state: ServerState, reqs: list[Request], is_disconnected: Callable[[], Awaitable[bool]] | None
) -> list[Request] | None:
    """Generate `reqs` together (a batched `/generate`); None when the client disconnected first (they are
    then aborted)."""
    task = asyncio.ensure_future(state.runner.generate_many(reqs))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if is_disconnected is not None and await is_disconnected():
                task.cancel()
                return None
    except asyncio.CancelledError:
        task.cancel()
        raise


def error_response(
    status: int, message: str, field: str | None = None, value: Any = None, **extra: Any
) -> JSONResponse:
    """SGLang's error body `{"error": {"message": ...}}`, plus the offending field and value."""
    error: dict[str, Any] = {"message": message, "type": "BadRequestError" if status < 500 else "InternalError",
                             "code": status}
    if field is not None:
        error["field"] = field
        error["value"] = _jsonable(value)
    return JSONResponse({"error": error, "success": False, "message": message, **extra}, status_code=status)


def invalid_request_response(exc: InvalidRequest) -> JSONResponse:
    return error_response(400, str(exc), exc.field, exc.value)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and len(value) <= 16:
        return [_jsonable(v) for v in value]
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
