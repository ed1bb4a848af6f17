"""OpenAI chat messages at the session edge: validation into one normal form, the history comparison that
decides whether a request extends a session, and the parse of a sampled reply into an assistant message.

Tool calls use the Hermes/Qwen wire shape (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`),
the shape verst's chat template renders (verst/models/chat_template.py).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from verst.session.errors import SessionError

ROLES = ("system", "user", "assistant", "tool")
_KNOWN_KEYS = ("role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content")
TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
REASONING = re.compile(r"<think>\n?(.*?)\n?</think>\n*", re.DOTALL)


# ---- validation -------------------------------------------------------------------------------
def normalize_messages(raw: Any, field: str = "messages") -> list[dict[str, Any]]:
    """Validated copies of `raw` holding only the keys a chat template reads; SessionError(400) naming the
    first bad message and field otherwise."""
    if not isinstance(raw, list) or not raw:
        raise SessionError(400, f"{field} must be a non-empty list of chat messages, got {raw!r:.80}", field)
    return [normalize_message(m, f"{field}[{i}]") for i, m in enumerate(raw)]


def normalize_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise SessionError(400, f"{where} must be an object with role and content, got {message!r:.80}", where)
    role = message.get("role")
    if role not in ROLES:
        raise SessionError(400, f"{where}.role = {role!r} is not one of {list(ROLES)}", f"{where}.role")
    for key, value in message.items():
        # the official client's model_dump() of a reply carries empty extras (refusal=None, annotations=[])
        if key not in _KNOWN_KEYS and value not in (None, [], {}, ""):
            raise SessionError(400, f"{where}.{key} = {value!r:.60} is not supported; known keys: {list(_KNOWN_KEYS)}",
                               f"{where}.{key}")
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), where)}
    if out["content"] is None and role != "assistant":
        raise SessionError(400, f"{where}.content is missing; a {role} message needs text", f"{where}.content")
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise SessionError(400, f"{where}.{key} = {value!r:.60} must be a string", f"{where}.{key}")
        out[key] = value
    if message.get("tool_calls"):
        if role != "assistant":
            raise SessionError(400, f"{where} has tool_calls but role {role!r}; only assistant messages call tools",
                               f"{where}.tool_calls")
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return out


def _content(content: Any, where: str) -> str | None:
    """Text content; a list of text parts is joined (OpenAI allows both), other parts are refused."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise SessionError(400, f"{where}.content[{j}] = {part!r:.60} is not a text part; only text is "
                                        "supported", f"{where}.content[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise SessionError(400, f"{where}.content = {content!r:.60} must be a string or a list of text parts",
                       f"{where}.content")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise SessionError(400, f"{where} = {calls!r:.60} must be a list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise SessionError(400, f"{where}[{j}] = {call!r:.80} needs function.name", f"{where}[{j}].function.name")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except ValueError:
                raise SessionError(400, f"{where}[{j}].function.arguments = {arguments!r:.60} is not valid JSON",
                                   f"{where}[{j}].function.arguments") from None
        elif not isinstance(arguments, dict):
            raise SessionError(400, f"{where}[{j}].function.arguments must be a JSON string or an object",
                               f"{where}[{j}].function.arguments")
        normal = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if call.get("id"):
            normal["id"] = str(call["id"])
        out.append(normal)
    return out


def check_tool_results(messages: list[dict[str, Any]], stored: Sequence[dict[str, Any]] = ()) -> None:
    """Every tool message answers a tool call of an earlier assistant message by its id; SessionError(400)
    naming `messages[i].tool_call_id` otherwise. The ids of `stored` replies count where the request resends
    them (a client that reserializes a reply may drop its call ids)."""
    known: set[str] = set()
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            known |= _call_ids(message)
            if i < len(stored) and stored[i]["role"] == "assistant":
                known |= _call_ids(stored[i])
        elif message["role"] == "tool":
            where, call_id = f"messages[{i}].tool_call_id", message.get("tool_call_id")
            if call_id is None:
                raise SessionError(400, f"{where} is missing; a tool message answers a tool call of an earlier "
                                        "assistant message by its id", where)
            if call_id not in known:
                raise SessionError(400, f"{where} = {call_id!r} matches no tool call of an earlier assistant "
                                        f"message (their ids: {sorted(known)})", where)


def _call_ids(message: dict[str, Any]) -> set[str]:
    return {call["id"] for call in message.get("tool_calls") or [] if "id" in call}


# ---- comparing histories ------------------------------------------------------------------------
def same_message(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    """Whether a resent message is the stored one. Loose where clients reserialize a reply: content None
    equals '', tool-call arguments compare as JSON and their ids are ignored, and a reply resent without
    its reasoning_content still matches (the stored message stays authoritative for rendering)."""
    if stored["role"] != replayed["role"] or (stored.get("content") or "") != (replayed.get("content") or ""):
        return False
    if stored.get("name") != replayed.get("name") or stored.get("tool_call_id") != replayed.get("tool_call_id"):
        return False
    if "reasoning_content" in replayed and replayed["reasoning_content"] != stored.get("reasoning_content"):
        return False
    return _call_keys(stored) == _call_keys(replayed)


def _call_keys(message: dict[str, Any]) -> list[tuple[str, Any]]:
    keys = []
    for call in message.get("tool_calls") or []:
        args = call["function"]["arguments"]
        keys.append((call["function"]["name"], json.loads(args) if isinstance(args, str) else args))
    return keys


def first_difference(stored: list[dict[str, Any]], request: list[dict[str, Any]]) -> int | None:
    """None if `request` starts with all of `stored`; else the index of the first stored message it
    changes or lacks."""
    for i, message in enumerate(stored):
        if i >= len(request) or not same_message(message, request[i]):
            return i
    return None


# ---- the sampled reply ---------------------------------------------------------------------------
def parse_reply(text: str, parse_tools: bool) -> dict[str, Any]:
    """The assistant message of a sampled text (special tokens already dropped): a leading `<think>` block
    becomes reasoning_content; with `parse_tools`, every `<tool_call>` block holding a JSON object with a
    name becomes an OpenAI tool call (blocks that do not parse stay in the content, as sampled)."""
    message: dict[str, Any] = {"role": "assistant"}
    if text.startswith("<think>") and (m := REASONING.match(text)):
        message["reasoning_content"] = m.group(1)
        text = text[m.end():]
    calls, kept, at = [], [], 0
    if parse_tools:
        for block in _TOOL_CALL.finditer(text):
            call = _parse_call(block.group(1))
            if call is not None:
                kept.append(text[at:block.start()])
                at = block.end()
                calls.append(call)
    kept.append(text[at:])
    content = "".join(kept)
    if calls:
        # the template writes content, '\n', then the blocks: only the whitespace around them is glue
        content = content.strip()
        message["tool_calls"] = calls
    message["content"] = content or (None if calls else "")
    return message


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}
