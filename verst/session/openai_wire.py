"""OpenAI chat-completion wire format for the session server: a request body checked into engine sampling
params, one turn as a `chat.completion` object, and the served model as a `model` object.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from verst.session.errors import SessionError
from verst.session.messages import normalize_messages

# OpenAI field -> SGLang sampling_params key, with the accepted type
_SAMPLING: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "temperature": ("temperature", (int, float)), "top_p": ("top_p", (int, float)), "top_k": ("top_k", int),
    "min_p": ("min_p", (int, float)), "seed": ("sampling_seed", int), "min_tokens": ("min_new_tokens", int),
    "stop": ("stop", (str, list)), "stop_token_ids": ("stop_token_ids", list), "ignore_eos": ("ignore_eos", bool),
}
OPENAI_NAMES = {key: name for name, (key, _) in _SAMPLING.items()} | {"max_new_tokens": "max_tokens"}
# accepted only at these values: the session server has no way to honour others
_OFF_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (1, None), "presence_penalty": (0, None), "frequency_penalty": (0, None), "top_logprobs": (0, None),
    "tool_choice": (None, "auto", "none"), "response_format": (None, {"type": "text"}), "logit_bias": (None, {}),
}
_IGNORED = ("model", "user", "parallel_tool_calls", "metadata", "store", "service_tier")
_OTHER = ("messages", "tools", "chat_template_kwargs", "max_tokens", "max_completion_tokens", "logprobs", "stream",
          "stream_options")


@dataclasses.dataclass
class ChatRequest:
    """A checked chat request: the messages, what fixes the template, and how to sample."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    sampling: dict[str, Any]  # SGLang sampling_params without max_new_tokens
    max_tokens: int | None
    max_tokens_field: str  # the name the request used: max_completion_tokens or max_tokens
    logprobs: bool
    stream: bool
    include_usage: bool
    parse_tools: bool  # tools given and tool_choice is not "none"
    model: str


def parse_request(body: Any) -> ChatRequest:
    """Check every field (SessionError(400) naming the first bad one) and translate the sampling ones."""
    if not isinstance(body, dict):
        raise SessionError(400, f"request body must be a JSON object, got {body!r:.80}", "body")
    known = set(_SAMPLING) | set(_OFF_ONLY) | set(_IGNORED) | set(_OTHER)
    unknown = sorted(set(body) - known)
    if unknown:
        raise SessionError(400, f"{unknown[0]} = {body[unknown[0]]!r:.60} is not supported by the session server; "
                                f"supported fields: {sorted(known)}", unknown[0])
    for name, allowed in _OFF_ONLY.items():
        if name in body and body[name] not in allowed:
            raise SessionError(400, f"{name} = {body[name]!r:.60} is not supported; allowed: {list(allowed)}", name)
    sampling = {}
    for name, (key, kind) in _SAMPLING.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise SessionError(400, f"{name} = {value!r:.60} has the wrong type", name)
        sampling[key] = value
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise SessionError(400, f"tools = {tools!r:.80} must be a list of tool objects", "tools")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise SessionError(400, f"chat_template_kwargs = {kwargs!r:.60} must be an object", "chat_template_kwargs")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(field)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise SessionError(400, f"{field} = {max_tokens!r} must be a positive integer", field)
    options = body.get("stream_options") or {}
    return ChatRequest(
        messages=normalize_messages(body.get("messages")), tools=tools, template_kwargs=kwargs, sampling=sampling,
        max_tokens=max_tokens, max_tokens_field=field, logprobs=_flag(body, "logprobs"), stream=_flag(body, "stream"),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        parse_tools=tools is not None and body.get("tool_choice") != "none", model=str(body.get("model") or ""),
    )


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise SessionError(400, f"{name} = {value!r:.60} must be true or false", name)
    return bool(value)


def completion(
    *, completion_id: str, model: str, message: dict[str, Any], finish_reason: str,
    logprob_entries: list[dict[str, Any]] | None, n_out: int, prompt_tokens: int, cached_tokens: int,
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """A `chat.completion` object of `n_out` output ids; `logprob_entries` given (`TokenTexts.entries`): the
    per-token logprobs. `metadata` is sent as strings (OpenAI types it as a map of strings); None values are
    left out."""
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
    if logprob_entries is not None:
        choice["logprobs"] = {"content": logprob_entries, "refusal": None}
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out,
                  "prompt_tokens_details": {"cached_tokens": cached_tokens}},
        "metadata": {key: str(value) for key, value in metadata.items() if value is not None},
    }


class TokenTexts:
    """Token ids as OpenAI's per-token logprobs show them: each id's own text and its UTF-8 bytes, decoded
    once per id (the set of ids a tokenizer has is bounded; a turn's output repeats most of them)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._known: dict[int, tuple[str, tuple[int, ...]]] = {}

    def entries(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        """OpenAI's `logprobs.content` entries, one per output id (the end-of-turn token included, so they
        line up with what the trainer sees)."""
        known = self._known
        for i in ids:
            if i not in known:
                text = self.tokenizer.decode([i], skip_special_tokens=False)
                known[i] = (text, tuple(text.encode("utf-8")))
        return [{"token": known[i][0], "logprob": lp, "bytes": known[i][1], "top_logprobs": []}
                for i, lp in zip(ids, logprobs, strict=True)]


def model_card(name: str, created: int) -> dict[str, Any]:
    """The served model as OpenAI's `model` object (what `client.models.list()` returns)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "verst"}
