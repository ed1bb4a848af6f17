"""A scripted stand-in engine at the HTTP edge, for testing agents and the session server without a model:
`/generate` answers (or streams) scripted reply texts (encoded, ended by the end-of-turn token) with
distinct logprobs, and every request is recorded with its routing key.

    engine = ScriptedEngine(tokenizer, ["<tool_call>\\n{...}\\n</tool_call>", "The sum is 3."])
    client = EngineClient("http://scripted", transport=engine)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx

from verst.inference_client.client import ROUTING_KEY_HEADER


@dataclasses.dataclass(frozen=True)
class Reply:
    """One scripted engine reply: `text` encoded; `finish` 'stop' appends the end-of-turn token. An 'abort'
    carries `message` (a weight update's, or another); `weight_version` and `oldest_weight_version` replace
    the engine's version (an update that fell inside the call, as under retract, gives the two differently)."""

    text: str
    finish: str = "stop"
    message: str | None = None
    weight_version: str | None = None
    oldest_weight_version: str | None = None


@dataclasses.dataclass
class GenerateCall:
    """What one /generate request carried, and what it was answered."""

    routing_key: str | None
    rid: str | None
    input_ids: list[int]
    sampling_params: dict[str, Any]
    output_ids: list[int]
    logprobs: list[float]


class ScriptedEngine(httpx.AsyncBaseTransport):
    """Each routing key walks `script` from its start (a session's n-th turn gets the n-th reply; past the
    end, the last one repeats). Keys in `down` get a connection error, as from an unreachable engine."""

    def __init__(self, tokenizer: Any, script: list[str | Reply], *, weight_version: str = "0", delay_s: float = 0.0,
                 context_length: int = 4096):
        if not script:
            raise ValueError("ScriptedEngine: script is empty; give at least one reply")
        self.tokenizer, self.weight_version, self.delay_s = tokenizer, weight_version, delay_s
        self.context_length = context_length  # what /get_model_info reports
        self.script = [r if isinstance(r, Reply) else Reply(r) for r in script]
        self.calls: list[GenerateCall] = []
        self.down: set[str] = set()
        self._turns: dict[str | None, int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ("/health", "/health_generate", "/abort_request", "/flush_cache"):
            return httpx.Response(200, json={})
        if path == "/get_model_info":
            return httpx.Response(200, json={"context_length": self.context_length, "weight_version": self.weight_version})
        if path != "/generate":
            return httpx.Response(404, json={"error": {"message": f"scripted engine has no route {path}"}})
        key = request.headers.get(ROUTING_KEY_HEADER)
        if key in self.down:
            raise httpx.ConnectError(f"scripted engine for routing key {key} is down", request=request)
        body = json.loads(request.content)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        reply = self.script[min(turn, len(self.script) - 1)]
        output = self.tokenizer.encode(reply.text, add_special_tokens=False)
        if reply.finish == "stop":
            output.append(self.tokenizer.eos_token_id)
        limit = body.get("sampling_params", {}).get("max_new_tokens")
        finish: dict[str, Any] = {"type": reply.finish} | ({"message": reply.message} if reply.message else {})
        if limit is not None and len(output) > limit:
            output, finish = output[:limit], {"type": "length", "length": limit}
        elif reply.finish == "stop":
            finish["matched"] = self.tokenizer.eos_token_id
        # distinct per call and position, so a test can tell every logprob's origin
        logprobs = [-(len(self.calls) + 1) - (i + 1) / 1000 for i in range(len(output))]
        self.calls.append(GenerateCall(key, body.get("rid"), list(body["input_ids"]), body.get("sampling_params", {}),
                                       output, logprobs))
        if body.get("stream"):  # SGLang's cumulative stream form: one event per output id
            events = [self._reply(body, reply, output[:n], logprobs[:n], finish if n == len(output) else None)
                      for n in range(1, len(output) + 1)]
            lines = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
            return httpx.Response(200, content=lines.encode(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=self._reply(body, reply, output, logprobs, finish))

    def _reply(self, body: dict[str, Any], reply: Reply, output: list[int], logprobs: list[float],
               finish: dict[str, Any] | None) -> dict[str, Any]:
        version = reply.weight_version or self.weight_version
        meta = {"id": body.get("rid") or "", "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(output), "cached_tokens": 0, "weight_version": version,
                "oldest_weight_version": reply.oldest_weight_version or version,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output, strict=True)]}
        return {"text": reply.text, "output_ids": output, "meta_info": meta}
