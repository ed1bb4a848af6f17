"""`VLLMAdapter`: `EngineAPI` on a vLLM server, through vLLM's own HTTP API (`/v1/completions` with token
ids and logprobs, `/pause`, `/resume`, `/reset_prefix_cache`, `/collective_rpc` reload_weights).

vLLM names no weights in its replies, so the adapter keeps the version and stamps each reply with it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import httpx

from verst.inference_client.protocol import InvalidRequest

# SGLang sampling_params → vLLM's completion fields of the same meaning. Anything else is refused by name.
SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "sampling_seed": "seed",
    "skip_special_tokens": "skip_special_tokens", "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty", "n": "n",
}
# SGLang pause modes → vLLM's. retract and in_place keep requests queued; /flush_cache after a retract
# pause resets their KV (reset_running_requests), so they recompute it with the new weights, as in SGLang.
PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}


class VLLMError(RuntimeError):
    """vLLM answered a control call with an error."""


class VLLMAdapter:
    """One vLLM server at `url`. `model_info`: what `get_model_info` reports besides the version (at least
    `model_path` and `vocab_size`, read from the checkpoint by the caller). `weights_path(path)`: the
    directory vLLM reloads for the checkpoint `path` (default: `path`; see `verst.engine_kinds.untie`)."""

    def __init__(self, url: str, *, weight_version: str = "0", model_info: dict[str, Any] | None = None,
                 timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None,
                 weights_path: Callable[[str], str] | None = None):
        self.url = url.rstrip("/")
        self.weights_path = weights_path
        self.version = str(weight_version)
        self.model_info = dict(model_info or {})
        self._http = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=5.0), transport=transport,
                                       limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self._in_flight: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()
        self._ids = itertools.count()

    async def close(self) -> None:
        await self._http.aclose()

    # ---- generation ------------------------------------------------------------------------------
    async def generate(self, input_ids: list[int] | None = None, sampling_params: dict[str, Any] | None = None, *,
                       rid: str | None = None, return_logprob: bool = True, text: str | None = None,
                       priority: int | None = None) -> dict[str, Any]:
        """`priority`: SGLang's (higher first), sent as vLLM's (lower first; the gateway starts vLLM with
        `--scheduling-policy priority`)."""
        body = completion_body(input_ids, text, sampling_params or {}, return_logprob)
        if priority:
            body["priority"] = -priority
        rid = rid or f"verst-{next(self._ids)}"
        if rid in self._in_flight:
            raise InvalidRequest("rid", rid, "a request with this rid is already in flight")
        body["request_id"] = rid
        started_version = self.version
        call = asyncio.ensure_future(self._http.post("/v1/completions", json=body))
        self._in_flight[rid] = call
        try:
            response = await call
        except asyncio.CancelledError:
            if rid in self._aborted and call.cancelled():  # abort(rid): the closed connection aborts it in vLLM
                return aborted_reply(rid, input_ids, self.version, started_version)
            raise
        finally:
            self._in_flight.pop(rid, None)
            self._aborted.discard(rid)
        if response.status_code >= 400:
            raise _refused(response)
        return completion_reply(response.json(), rid, input_ids, self.version, started_version)

    async def abort(self, rid: str) -> None:
        call = self._in_flight.get(rid)
        if call is not None:
            self._aborted.add(rid)
            call.cancel()

    async def abort_all(self) -> None:
        for rid in list(self._in_flight):
            await self.abort(rid)
        await self._control("/abort_requests", json={})

    # ---- pause, cache, weights ---------------------------------------------------------------------
    async def pause(self, mode: str = "retract") -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise InvalidRequest("mode", mode, f"pause mode must be one of {sorted(PAUSE_MODES)}")
        await self._control("/pause", params={"mode": PAUSE_MODES[mode]})
        return {"success": True, "message": f"paused ({mode}: vLLM mode {PAUSE_MODES[mode]!r})"}

    async def continue_generation(self) -> dict[str, Any]:
        await self._control("/resume")
        return {"success": True, "message": "resumed"}

    async def flush_cache(self) -> dict[str, Any]:
        reply = await self._control("/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not reply.get("success", False):
            raise VLLMError(f"{self.url}/reset_prefix_cache did not reset the prefix cache: {reply}")
        return {"success": True, "message": "Cache flushed."}

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       **extra: Any) -> dict[str, Any]:
        if extra:
            name = sorted(extra)[0]
            raise InvalidRequest(name, extra[name], "not supported by the vLLM adapter (model_path, weight_version)")
        path = await asyncio.to_thread(self.weights_path, str(model_path)) if self.weights_path else str(model_path)
        reply = await self._control("/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": path}})
        if weight_version is not None:
            await self.update_weight_version(str(weight_version))
        return {"success": True, "message": f"reloaded weights from {model_path}", "results": reply.get("results")}

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict[str, Any]:
        if abort_all_requests:
            await self.abort_all()
        self.version = str(new_version)
        await self._control("/update_weight_version", json={"new_version": self.version})  # vLLM's own label too
        return {"success": True, "new_version": self.version}

    # ---- state ------------------------------------------------------------------------------------------
    async def get_weight_version(self) -> str:
        return self.version

    async def get_model_info(self) -> dict[str, Any]:
        return {**self.model_info, "weight_version": self.version, "is_generation": True}

    async def get_load(self) -> list[dict[str, Any]]:
        reply = await self._control("/load", method="GET")
        return [{"dp_rank": 0, "num_reqs": int(reply.get("server_load", 0)), "num_waiting_reqs": 0}]

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health", timeout=5.0)).status_code == 200
        except httpx.TransportError:
            return False

    async def _control(self, path: str, *, json: Any = None, params: dict | None = None,
                       method: str = "POST") -> dict[str, Any]:
        response = await self._http.request(method, path, json=json, params=params)
        if response.status_code >= 400:
            raise VLLMError(f"{self.url}{path}: {response.status_code} {response.text[:500]}")
        return response.json() if response.content else {}


def completion_body(input_ids: list[int] | None, text: str | None, sampling: dict[str, Any],
                    return_logprob: bool) -> dict[str, Any]:
    """The `/v1/completions` body of one SGLang-style generation (token ids in, token ids out)."""
    if (input_ids is None) == (text is None):
        raise InvalidRequest("input_ids", input_ids, "give exactly one of input_ids and text")
    body: dict[str, Any] = {"prompt": list(input_ids) if input_ids is not None else text, "return_token_ids": True,
                            "max_tokens": 128, "logprobs": 0 if return_logprob else None}
    for name, value in sampling.items():
        if name not in SAMPLING_FIELDS:
            raise InvalidRequest(f"sampling_params.{name}", value, "not supported by the vLLM adapter; supported: "
                                 + ", ".join(sorted(SAMPLING_FIELDS)))
        if name == "n" and value not in (1, None):
            raise InvalidRequest("sampling_params.n", value, "one sample per request (send n requests)")
        if value is not None:
            body[SAMPLING_FIELDS[name]] = value
    if body.get("top_k") == -1:
        body["top_k"] = 0  # vLLM's 'all tokens'
    return body


def completion_reply(data: dict[str, Any], rid: str, input_ids: list[int] | None, version: str,
                     started_version: str) -> dict[str, Any]:
    """A `/v1/completions` reply as SGLang's `/generate` reply."""
    choice = data["choices"][0]
    ids = list(choice.get("token_ids") or [])
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    usage = data.get("usage") or {}
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    finish = choice.get("finish_reason") or "abort"
    reason: dict[str, Any] = {"type": finish}  # SGLang's shapes: length names the length, stop what matched
    if finish == "length":
        reason["length"] = len(ids)
    elif finish == "stop":
        stop = choice.get("stop_reason")
        reason["matched"] = stop if stop is not None else (ids[-1] if ids else None)  # None: an EOS token
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": reason,
        "prompt_tokens": int(usage.get("prompt_tokens", len(input_ids or []))),
        "completion_tokens": int(usage.get("completion_tokens", len(ids))), "cached_tokens": int(cached),
        "weight_version": version,
    }
    if started_version != version:
        meta["oldest_weight_version"] = started_version
    if logprobs is not None:
        meta["output_token_logprobs"] = [[float(lp), tok, None] for lp, tok in zip(logprobs, ids)]
    return {"text": choice.get("text", ""), "output_ids": ids, "meta_info": meta}


def aborted_reply(rid: str, input_ids: list[int] | None, version: str, started_version: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "finish_reason": {"type": "abort"},
                            "prompt_tokens": len(input_ids or []), "completion_tokens": 0, "cached_tokens": 0,
                            "weight_version": version, "output_token_logprobs": []}
    if started_version != version:
        meta["oldest_weight_version"] = started_version
    return {"text": "", "output_ids": [], "meta_info": meta}


def _refused(response: httpx.Response) -> Exception:
    """vLLM's 4xx names its own field; the gateway passes it on as a 400 (5xx: an engine error)."""
    try:
        error = response.json().get("error") or {}
        message = error.get("message") if isinstance(error, dict) else str(error)
        param = error.get("param") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message, param = response.text[:500], None
    if response.status_code < 500:
        return InvalidRequest(f"vllm.{param}" if param else "request", None, f"vLLM refused it: {message}")
    return VLLMError(f"vLLM answered {response.status_code}: {message}")
