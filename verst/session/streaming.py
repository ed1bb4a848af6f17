"""One streamed turn as OpenAI `chat.completion.chunk` server-sent events, built from the engine's output
ids as they come: content as it becomes final, then the parsed reply's rest, finish reason and usage.

Content streams only as far as the whole reply's parse (`parse_reply`) is sure to keep it, so the deltas a
client accumulates are exactly the message the session stores, and a resent history still matches it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from verst.session.errors import SessionError
from verst.session.messages import REASONING, TOOL_CALL_OPEN
from verst.session.openai_wire import TokenTexts

logger = logging.getLogger(__name__)
_THINK_OPEN = "<think>"


def final_prefix(text: str, parse_tools: bool) -> tuple[str | None, str]:
    """(reasoning, content): what a reply's text so far fixes of its parsed message. The reasoning once its
    `<think>` block closed; the longest content prefix no later text can change: up to the first
    `<tool_call>` (or what may begin one), without trailing whitespace (stripped around tool calls) and
    without a trailing partial character."""
    reasoning = None
    if text.startswith(_THINK_OPEN) or _THINK_OPEN.startswith(text):
        match = REASONING.match(text)
        if match is None or match.end() == len(text):  # still open, or newlines after it may go on
            return None, ""
        reasoning, text = match.group(1), text[match.end():]
    text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence decodes to U+FFFD until its last byte comes
    if parse_tools:
        at = text.find(TOOL_CALL_OPEN)
        text = text[:at] if at >= 0 else text[:len(text) - _partial_suffix(text, TOOL_CALL_OPEN)]
        if text[:1].isspace():  # kept if no tool call follows, stripped if one does: unknown until the end
            return reasoning, ""
        text = text.rstrip()
    return reasoning, text


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest proper prefix of `marker` that `text` ends with."""
    return next((k for k in range(len(marker) - 1, 0, -1) if text.endswith(marker[:k])), 0)


class ChunkStream:
    """The events of one streamed turn: `update` after each engine update (cumulative output ids and
    logprobs), `finish` with the turn's `chat.completion` reply, or `error`."""

    def __init__(self, tokenizer: Any, *, model: str, parse_tools: bool, logprobs: bool, include_usage: bool,
                 token_texts: TokenTexts):
        self.token_texts = token_texts
        self.tokenizer, self.parse_tools, self.logprobs, self.include_usage = tokenizer, parse_tools, logprobs, include_usage
        self.head: dict[str, Any] = {"id": "", "object": "chat.completion.chunk", "created": int(time.time()),
                                     "model": model}
        self.sent_content, self.sent_reasoning, self.sent_tokens, self.started = "", False, 0, False

    def update(self, completion_id: str, output_ids: list[int], logprobs: list[float] | None) -> list[str]:
        """Events for the output ids past those already covered (none while nothing new is final)."""
        self.head["id"] = self.head["id"] or completion_id
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        reasoning, content = final_prefix(text, self.parse_tools)
        delta: dict[str, Any] = {}
        if reasoning is not None and not self.sent_reasoning:
            delta["reasoning_content"], self.sent_reasoning = reasoning, True
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            delta["content"], self.sent_content = content[len(self.sent_content):], content
        entries = None
        if self.logprobs and logprobs is not None and len(output_ids) > self.sent_tokens:
            entries = self.token_texts.entries(output_ids[self.sent_tokens:], logprobs[self.sent_tokens:len(output_ids)])
            self.sent_tokens = len(output_ids)
        if not delta and entries is None:
            return []
        return [self._chunk(delta, None, entries)]

    def finish(self, reply: dict[str, Any]) -> list[str]:
        """The reply's rest (content not yet sent, reasoning, tool calls, remaining logprobs) with its finish
        reason and metadata, then the usage chunk when asked for, then [DONE]."""
        self.head["id"] = self.head["id"] or reply["id"]
        choice = reply["choices"][0]
        message = choice["message"]
        delta: dict[str, Any] = {}
        content = message.get("content") or ""
        if content.startswith(self.sent_content):
            rest = content[len(self.sent_content):]
            if rest or not self.started:
                delta["content"] = rest
        else:  # final_prefix guarantees a prefix; a tokenizer whose decoding of a prefix changes may not
            logger.warning("streamed content %r is not a prefix of the reply's %r", self.sent_content, content)
        if message.get("reasoning_content") is not None and not self.sent_reasoning:
            delta["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        entries = None
        if choice["logprobs"] is not None and len(choice["logprobs"]["content"]) > self.sent_tokens:
            entries = choice["logprobs"]["content"][self.sent_tokens:]
        events = [self._chunk(delta, choice["finish_reason"], entries, metadata=reply.get("metadata"))]
        if self.include_usage:
            events.append(_event(self.head | {"choices": [], "usage": reply["usage"]}))
        return events + ["data: [DONE]\n\n"]

    @staticmethod
    def error(exc: SessionError) -> list[str]:
        """A failure after the stream began: OpenAI's error event (the client raises it), then [DONE]."""
        return [_event(exc.to_openai()), "data: [DONE]\n\n"]

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None, entries: list[dict] | None,
               metadata: dict[str, str] | None = None) -> str:
        if not self.started:
            delta, self.started = {"role": "assistant", **delta}, True
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": {"content": entries, "refusal": None} if entries is not None else None}
        chunk = self.head | {"choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's form: only the last chunk carries usage
        if metadata:
            chunk["metadata"] = metadata
        return _event(chunk)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {orjson.dumps(payload).decode()}\n\n"
