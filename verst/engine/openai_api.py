"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models` over the same engine.

Non-streaming. Logprobs come in OpenAI's shapes; `return_token_ids: true` (vLLM's extension) adds the
prompt and completion token ids to each choice, and `metadata.weight_version` names the weights used.
A LoRA adapter is named as SGLang takes it: `model = "<base>:<adapter>"`, or the `lora_path` field.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from verst.engine.request import Request as EngineRequest
from verst.engine.service import ServerState, build_request, error_response, run_to_completion
from verst.inference_client.protocol import (
    InvalidRequest,
    PromptIds,
    SamplingOptions,
    SamplingParams,
    check_default_only,
)

# OpenAI fields accepted only at their "off" value; anything else is refused by name.
_OFF_VALUES = {"n": (1, None), "best_of": (1, None), "echo": (False, None), "stream": (False, None),
               "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logit_bias": (None,),
               "suffix": (None,), "response_format": (None,), "tool_choice": (None, "none", "auto"),
               "parallel_tool_calls": (None, True, False), "stream_options": (None,)}


class _OpenAIBase(SamplingOptions):
    """The shared sampling fields plus those OpenAI names its own way (seed, min_tokens, max_tokens)."""

    accepted_only_at: ClassVar[dict[str, tuple[Any, ...]]] = _OFF_VALUES
    model: str | None = None
    seed: int | None = Field(None, ge=0)
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    user: str | None = None
    lora_path: str | None = Field(None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _off_only(cls, data: Any) -> Any:
        return check_default_only(data, _OFF_VALUES, "")

    def adapter(self, state: ServerState) -> str | None:
        """The LoRA adapter named by `model` ("<base>:<adapter>") or by `lora_path`; None: the base.

        `model` is otherwise not checked, so a model name that merely contains a colon still means the
        base: the part after the last colon names an adapter when one of that name is loaded or when
        the part before it is the served model's name (an unknown adapter is then refused by name)."""
        named = None
        if self.model and ":" in self.model:
            base, suffix = self.model.rsplit(":", 1)
            if suffix in state.core.loras.adapters or base == state.served_model_name:
                named = suffix
        if named and self.lora_path and named != self.lora_path:
            raise InvalidRequest("lora_path", self.lora_path, f"differs from the adapter {named!r} named by model")
        return named or self.lora_path

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """The engine's sampling params; the fields are validated already, so none is checked again."""
        shared = {name: getattr(self, name) for name in SamplingOptions.model_fields}
        return SamplingParams.model_construct(
            **shared, max_new_tokens=max_tokens, min_new_tokens=self.min_tokens, sampling_seed=self.seed,
        )


class ChatMessage(BaseModel):
    """One chat message: a role the chat templates know and what it says, its content or (an assistant's)
    tool calls; other OpenAI message fields (name, tool_call_id, reasoning_content) pass through to the template."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["role", "tool_calls"], "properties": {"role": {"const": "assistant"},
                                                            "tool_calls": {"type": "array", "minItems": 1}}},
    ]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[dict[str, Any]] | None = None
    content: str | list[dict[str, Any]] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _says_something(cls, content: Any, info: ValidationInfo) -> Any:
        """A message without content renders as an empty turn the model never saw in training; only an
        assistant's tool calls stand without it."""
        role = info.data.get("role")
        if content is None and role is not None and not (role == "assistant" and info.data.get("tool_calls")):
            needs = "content or tool_calls" if role == "assistant" else "content"
            raise ValueError(f"a message of role {role!r} needs {needs}")
        return content


class CompletionRequest(_OpenAIBase):
    prompt: str | PromptIds
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None


NO_CHAT_TEMPLATE = ("this model has no chat template (a model trained on raw prompts, data.apply_chat_template "
                    "= false, is exported without one): send the prompt text or token ids to /v1/completions")


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.served_model_name, "object": "model", "owned_by": "verst"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ids = body.prompt if isinstance(body.prompt, list) else state.encode(body.prompt, "prompt")
        want = body.logprobs is not None
        req = build_request(state, ids, body.sampling(body.max_tokens), return_logprob=want,
                            top_logprobs_num=body.logprobs or 0, lora_path=body.adapter(state))
        done = await run_to_completion(state, req, request.is_disconnected)
        if done is None:
            return Response(status_code=499)
        choice: dict[str, Any] = {"index": 0, "text": done.text or "", **_finish(done),
                                  "logprobs": _completion_logprobs(state, done) if want else None}
        if body.return_token_ids:
            choice.update(prompt_token_ids=done.prompt_ids, token_ids=done.output_ids)
        return JSONResponse(_envelope(state, done, "cmpl", "text_completion", choice))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        from jinja2 import TemplateError

        from verst.models.loader import chat_prompt_ids

        messages = [m.model_dump(exclude_unset=True) for m in body.messages]
        if not getattr(state.tokenizer, "chat_template", None):
            return error_response(400, NO_CHAT_TEMPLATE, "messages")
        try:
            ids = chat_prompt_ids(state.tokenizer, messages, tools=body.tools)
        except (ValueError, KeyError, TypeError, TemplateError) as exc:
            return error_response(400, f"messages: cannot apply the chat template ({exc})", "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        req = build_request(state, ids, body.sampling(max_tokens), return_logprob=body.logprobs,
                            top_logprobs_num=(body.top_logprobs or 0) if body.logprobs else 0,
                            lora_path=body.adapter(state))
        done = await run_to_completion(state, req, request.is_disconnected)
        if done is None:
            return Response(status_code=499)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": done.text or ""},
                                  **_finish(done), "logprobs": _chat_logprobs(state, done) if body.logprobs else None}
        if body.return_token_ids:
            choice.update(prompt_token_ids=done.prompt_ids, token_ids=done.output_ids)
        return JSONResponse(_envelope(state, done, "chatcmpl", "chat.completion", choice))


def _finish(req: EngineRequest) -> dict[str, Any]:
    reason: Literal["stop", "length", "abort"] = req.finish.type if req.finish else "abort"
    return {"finish_reason": reason, "matched_stop": req.finish.matched if req.finish else None}


def _envelope(state: ServerState, req: EngineRequest, prefix: str, kind: str, choice: dict) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{req.rid}", "object": kind, "created": int(time.time()), "model": state.served_model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
            "total_tokens": req.num_tokens, "prompt_tokens_details": {"cached_tokens": max(req.cached_tokens, 0)},
        },
        "metadata": {"weight_version": req.weight_version},
    }


def _completion_logprobs(state: ServerState, req: EngineRequest) -> dict[str, Any]:
    tokens = [state.token_text(t) for t in req.output_ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = None
    if req.top_logprobs_num:
        top = [{state.token_text(t): lp for lp, t in row} for row in req.output_top_logprobs]
    return {"tokens": tokens, "token_logprobs": list(req.output_logprobs), "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(state: ServerState, req: EngineRequest) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = state.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (token, logprob) in enumerate(zip(req.output_ids, req.output_logprobs)):
        item = entry(token, logprob)
        tops = req.output_top_logprobs[i] if req.top_logprobs_num else []
        item["top_logprobs"] = [entry(t, lp) for lp, t in tops]
        content.append(item)
    return {"content": content}
