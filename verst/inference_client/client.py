"""Async client of one engine, or of sglang-router in front of engines, in SGLang's native HTTP dialect.

All rollout code reaches inference through this class. Timeouts are bounded; only idempotent GETs are
retried; a request that needs session affinity must carry a routing key (sent as `X-SMG-Routing-Key`),
never silently falling back to load-based placement. Imports no torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from verst.inference_client.batching import RequestBatcher
from verst.inference_client.images import ImageResult, image_replies
from verst.inference_client.pooled import PooledWire
from verst.inference_client.replies import (  # what callers of the client catch and read, here as well
    EngineError,
    GenerateResult,
    RoutingKeyError,
    engine_went_away,
    error_field,
    error_message,
    json_or_raise,
    transport_error_text,
)
from verst.inference_client.wire import AiohttpWire, HttpxWire, WireError, WireName, WireTimeout

__all__ = ["EngineClient", "EngineError", "GenerateResult", "RoutingKeyError", "Timeouts", "engine_went_away"]

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds. `generate` bounds one whole generation; `weights` one weight update."""

    connect: float = 5.0
    generate: float = 600.0
    control: float = 60.0
    weights: float = 600.0


class EngineClient:
    """Talks to one base URL (an engine or a router). Use as `async with EngineClient(url) as c: ...`.

    `affinity=True` marks every generate as needing session affinity (multi-turn work behind a router
    in manual policy): a call without `routing_key` then raises `RoutingKeyError`. `generate_retries`:
    a generation whose engine went away (connection lost, or the router's 502/503/504) is sent again,
    after a backoff, up to that many times (behind a router, it goes to another engine); `retried` counts them. `max_batch > 1` sends
    generate calls made in the same event-loop turn as batched requests of up to that many prompts
    (`RequestBatcher`); the server must accept SGLang's batch form (the embedded engine and SGLang do).
    `lora_path`: the adapter every generate names unless the call names one (a LoRA run's policy adapter).
    """

    def __init__(
        self, base_url: str, *, timeouts: Timeouts | None = None, affinity: bool = False,
        max_connections: int = 1024, get_retries: int = 3, transport: httpx.AsyncBaseTransport | None = None,
        max_batch: int = 1, generate_retries: int = 0, retry_backoff_s: float = 1.0, lora_path: str | None = None,
        wire: WireName | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.lora_path = lora_path
        self.generate_retries, self.retry_backoff_s, self.retried = generate_retries, retry_backoff_s, 0
        self.timeouts = timeouts or Timeouts()
        self.affinity = affinity
        self.get_retries = get_retries
        wire = wire or ("httpx" if transport is not None else "aiohttp" if base_url.startswith("https") else "pooled")
        if wire != "httpx" and transport is not None:
            raise ValueError(f"EngineClient: an httpx transport needs wire='httpx', got wire={wire!r}")
        # streamed generations always go through httpx (their pools are made at first use)
        self._streams = HttpxWire(self.base_url, max_connections, self.timeouts.connect, self.timeouts.control,
                                  transport)
        if wire == "httpx":
            self._wire: PooledWire | AiohttpWire | HttpxWire = self._streams
        elif wire == "aiohttp":
            self._wire = AiohttpWire(self.base_url, max_connections, self.timeouts.connect)
        else:
            self._wire = PooledWire(self.base_url, max_connections, self.timeouts.connect)
        # max_batch > 1: generate calls made together share batched /generate requests (SGLang's list form)
        self._batcher = RequestBatcher(self._send_generate, max_batch) if max_batch > 1 else None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._wire is not self._streams:
            await self._wire.close()
        await self._streams.close()

    # ---- generation ----------------------------------------------------------------------------------
    async def generate(
        self, input_ids: list[int] | None = None, sampling_params: dict[str, Any] | None = None, *,
        text: str | None = None, rid: str | None = None, return_logprob: bool = True,
        routing_key: str | None = None, needs_affinity: bool | None = None, return_routed_experts: bool = False,
        top_logprobs_num: int = 0, priority: int | None = None, lora_path: str | None = None,
    ) -> GenerateResult:
        """One generation. Aborted requests return normally with `finish_reason == "abort"`. `priority`:
        SGLang's scheduling priority (higher first; SGLang needs --enable-priority-scheduling).
        `lora_path`: the name of a loaded LoRA adapter to generate with (None: the client's `lora_path`,
        which is None for the base model)."""
        body, headers = self._generate_body(
            input_ids, sampling_params, text=text, rid=rid, return_logprob=return_logprob, routing_key=routing_key,
            needs_affinity=needs_affinity, return_routed_experts=return_routed_experts,
            top_logprobs_num=top_logprobs_num, priority=priority, lora_path=lora_path)
        if self._batcher is not None:
            return GenerateResult.from_reply(await self._batcher.submit(body, headers))
        return GenerateResult.from_reply(await self._send_generate(body, headers))

    async def generate_samples(
        self, input_ids: list[int], sampling_params: dict[str, Any], n: int, *, rid: str | None = None,
        return_logprob: bool = True, routing_key: str | None = None, needs_affinity: bool | None = None,
        return_routed_experts: bool = False,
    ) -> list[GenerateResult]:
        """`n` generations of one prompt in one request (SGLang's parallel sampling, `sampling_params.n`): sample
        i runs as `{rid}_{i}` and, with `sampling_seed` s, is seeded s + i on verst's engines (SGLang seeds every
        sample alike); `abort(rid)` ends them all. Never batched with other calls; retried as `generate` is."""
        if n < 1:
            raise ValueError(f"generate_samples: n = {n} must be >= 1")
        body, headers = self._generate_body(
            input_ids, {**sampling_params, "n": n}, rid=rid, return_logprob=return_logprob, routing_key=routing_key,
            needs_affinity=needs_affinity, return_routed_experts=return_routed_experts)
        replies = await self._send_generate(body, headers)
        replies = replies if n > 1 or isinstance(replies, list) else [replies]
        if not isinstance(replies, list) or len(replies) != n:
            got = f"a list of {len(replies)}" if isinstance(replies, list) else type(replies).__name__
            raise ValueError(f"{self.base_url}/generate: asked for sampling_params.n = {n} samples, got {got}")
        return [GenerateResult.from_reply(reply) for reply in replies]

    async def score(
        self, input_ids: list[int], start: int, sampling_params: dict[str, Any] | None = None, *,
        rid: str | None = None,
    ) -> list[float]:
        """log p(input_ids[t] | input_ids[:t]) for t = start .. len - 1 from one prefill: SGLang's `/generate`
        with `max_new_tokens` 0, `return_logprob` and `logprob_start_len = start` (>= 1), read from
        `meta_info.input_token_logprobs`. `sampling_params` may set the temperature the logprobs are taken at.
        Never batched: each call is one request (through a router too). Retried as `generate` is."""
        if not 1 <= start < len(input_ids):
            raise ValueError(f"score: start = {start} must be in [1, len(input_ids) = {len(input_ids)}); position 0 "
                             "has no logprob")
        body, _ = self._generate_body(input_ids, {**(sampling_params or {}), "max_new_tokens": 0}, rid=rid,
                                      return_logprob=True, routing_key=None, needs_affinity=False, lora_path=None)
        body["logprob_start_len"] = start
        body.pop("lora_path", None)  # the base model scores: a client's adapter is for its generations
        reply = await self._send_generate(body, None)
        triples = (reply.get("meta_info") or {}).get("input_token_logprobs")
        want = len(input_ids) - start
        if triples is None or len(triples) < want:
            raise EngineError(self.base_url + "/generate", 200, f"score: the reply holds {len(triples or [])} "
                              f"input_token_logprobs for {want} scored tokens (logprob_start_len = {start})")
        ids = [item[1] for item in triples[-want:]]
        if ids != list(input_ids[start:]):
            raise EngineError(self.base_url + "/generate", 200, "score: input_token_logprobs name other token ids "
                              f"than were sent ({ids[:5]}... vs {list(input_ids[start:start + 5])}...)")
        return [float(item[0]) for item in triples[-want:]]

    async def generate_stream(
        self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *, rid: str | None = None,
        return_logprob: bool = True, routing_key: str | None = None, needs_affinity: bool | None = None,
        lora_path: str | None = None,
    ) -> AsyncIterator[GenerateResult]:
        """One generation streamed (`"stream": true`): a result covering every output id so far after each
        update; finish_reason is "" until the last. Both of SGLang's stream forms are read: cumulative
        output ids (the default) and incremental ones (`--incremental-streaming-output`). Never retried."""
        body, headers = self._generate_body(input_ids, sampling_params, rid=rid, return_logprob=return_logprob,
                                            routing_key=routing_key, needs_affinity=needs_affinity, lora_path=lora_path)
        body["stream"] = True
        url = self.base_url + "/generate"
        ids: list[int] = []
        logprobs: list[list[Any]] = []
        try:
            async with self._streams.pool().stream(
                    "POST", "/generate", json=body, headers=headers, timeout=self.timeouts.generate) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise EngineError(url, response.status_code, error_message(response), error_field(response))
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    try:
                        reply = json.loads(line[5:])
                        error = reply.get("error")
                        if error is None:
                            meta = reply["meta_info"]
                            if len(reply["output_ids"]) < int(meta.get("completion_tokens", 0)):  # incremental form
                                ids += reply["output_ids"]
                                logprobs += meta.get("output_token_logprobs") or []
                            else:
                                ids, logprobs = list(reply["output_ids"]), list(meta.get("output_token_logprobs") or [])
                    except (ValueError, KeyError, TypeError, AttributeError) as exc:
                        raise EngineError(url, response.status_code, f"unreadable stream event {line[:200]!r} "
                                                                     f"({type(exc).__name__}: {exc})") from None
                    if error is not None:
                        message = error.get("message", error) if isinstance(error, dict) else error
                        raise EngineError(url, response.status_code, str(message))
                    whole = {**reply, "output_ids": ids, "meta_info": {**meta, "output_token_logprobs": logprobs}}
                    if not return_logprob:
                        whole["meta_info"].pop("output_token_logprobs")
                    result = GenerateResult.from_reply(whole)
                    if not meta.get("finish_reason"):
                        result.finish_reason = ""  # not finished yet (from_reply reads a missing reason as abort)
                    yield result
        except httpx.TimeoutException as exc:
            raise EngineError(url, None, f"timed out after {self.timeouts.generate:g}s ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise EngineError(url, None, transport_error_text(exc)) from exc

    def _generate_body(
        self, input_ids: list[int] | None, sampling_params: dict[str, Any] | None, *, text: str | None = None,
        rid: str | None, return_logprob: bool, routing_key: str | None, needs_affinity: bool | None,
        return_routed_experts: bool = False, top_logprobs_num: int = 0, priority: int | None = None,
        lora_path: str | None = None,
    ) -> tuple[dict[str, Any], dict[str, str] | None]:
        """The /generate body and headers of one generation (RoutingKeyError when affinity lacks a key)."""
        if (needs_affinity if needs_affinity is not None else self.affinity) and not routing_key:
            raise RoutingKeyError(
                "this generate needs session affinity (the router pins a session to the engine holding its "
                f"prefix through the {ROUTING_KEY_HEADER} header) but routing_key is {routing_key!r}; "
                "pass routing_key=<session id>"
            )
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if input_ids is not None:  # a list is sent as it is (encoded when the request goes out), not copied
            body["input_ids"] = input_ids if isinstance(input_ids, list) else list(input_ids)
        if text is not None:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        if return_routed_experts:
            body["return_routed_experts"] = True
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        if priority is not None:
            body["priority"] = priority  # shared by a batch: calls of other priorities batch apart
        lora_path = lora_path if lora_path is not None else self.lora_path
        if lora_path is not None:
            body["lora_path"] = lora_path
        return body, {ROUTING_KEY_HEADER: routing_key} if routing_key else None

    async def _send_generate(self, body: dict[str, Any], headers: dict[str, str] | None) -> Any:
        for attempt in range(self.generate_retries + 1):
            try:
                return await self._post("/generate", body, self.timeouts.generate, headers=headers, spread=True)
            except EngineError as error:
                if attempt == self.generate_retries or not engine_went_away(error):
                    raise
                self.retried += 1
                await asyncio.sleep(min(self.retry_backoff_s * 2**attempt, 8.0))  # the engine's removal, meanwhile
        raise AssertionError("unreachable")

    async def generate_images(self, text: str, sampling_params: dict[str, Any] | None = None, *,
                              rid: str | None = None, return_logprob: bool = False) -> list[ImageResult]:
        """The diffusion engine's images of one class description (`n` of them, seeds `sampling_seed + i`),
        decoded; refused when a reply was sampled with other settings than `sampling_params` asks for."""
        sampling_params = dict(sampling_params or {})
        body = {"text": text, "sampling_params": sampling_params, "return_logprob": return_logprob,
                **({"rid": rid} if rid is not None else {})}
        replies = image_replies(await self._send_generate(body, None))
        return [ImageResult.from_reply(reply).check(sampling_params) for reply in replies]

    async def abort(self, rid: str) -> None:
        await self._post("/abort_request", {"rid": rid}, self.timeouts.control)

    async def abort_all(self) -> None:
        await self._post("/abort_request", {"abort_all": True}, self.timeouts.control)

    async def pause(self, mode: str = "retract") -> dict[str, Any]:
        return await self._post("/pause_generation", {"mode": mode}, self.timeouts.control)

    async def continue_generation(self) -> dict[str, Any]:
        return await self._post("/continue_generation", {}, self.timeouts.control)

    async def flush_cache(self) -> dict[str, Any]:
        return await self._post("/flush_cache", {}, self.timeouts.control)

    # ---- weights --------------------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, weight_version: str, **extra: Any) -> dict[str, Any]:
        body = {"model_path": model_path, "weight_version": weight_version, **extra}
        return await self._post("/update_weights_from_disk", body, self.timeouts.weights)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], weight_version: str | None,
                                         flush_cache: bool = True, **adapter: Any) -> dict:
        """SGLang's tensor load: one entry per tensor-parallel rank, each from
        `verst.inference_client.tensor_payload.serialize_named_tensors` (the sender keeps the tensors alive
        until this returns). `adapter`: `lora_name` and `lora_config` when the tensors are a whole LoRA adapter
        (the embedded engine's extension)."""
        body = {"serialized_named_tensors": serialized_named_tensors, "load_format": None, "flush_cache": flush_cache,
                "weight_version": weight_version, **adapter}
        return await self._post("/update_weights_from_tensor", body, self.timeouts.weights)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "gloo",
    ) -> dict[str, Any]:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self._post("/init_weights_update_group", body, self.timeouts.weights)

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], weight_version: str,
        group_name: str = "weight_update_group", flush_cache: bool = True, load_format: str | None = None,
        **adapter: Any,
    ) -> dict[str, Any]:
        """`load_format="flattened_bucket"`: the tensors (one dtype) come in one broadcast, end to end.
        `adapter`: `lora_name` and `lora_config` when the tensors are a whole LoRA adapter."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache, "weight_version": weight_version, **adapter}
        if load_format is not None:
            body["load_format"] = load_format
        return await self._post("/update_weights_from_distributed", body, self.timeouts.weights)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, update_in_flight: bool = False) -> dict[str, Any]:
        """Serve the PEFT adapter directory `lora_path` under `lora_name` (replacing one of that name);
        `update_in_flight` (verst's engine): requests in flight on the replaced one go on with the new one."""
        body: dict[str, Any] = {"lora_name": lora_name, "lora_path": lora_path}
        if update_in_flight:
            body["update_in_flight"] = True
        return await self._post("/load_lora_adapter", body, self.timeouts.weights)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await self._post("/unload_lora_adapter", {"lora_name": lora_name}, self.timeouts.weights)

    async def set_cores(self, cores: list[int], threads: int) -> Any:
        """The embedded engine computes on `cores` with `threads` torch threads from now on (verst's route)."""
        return await self._post("/set_cores", {"cores": cores, "threads": threads}, self.timeouts.control)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        """Give the device memory to a colocated trainer (`tags`: weights, kv_cache; None: both). SGLang answers
        null, the embedded engine the bytes each tag freed."""
        return await self._post("/release_memory_occupation", {"tags": tags}, self.timeouts.weights)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        """Take back what `release_memory_occupation` gave (None: every released tag)."""
        return await self._post("/resume_memory_occupation", {"tags": tags}, self.timeouts.weights)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict[str, Any]:
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return await self._post("/update_weight_version", body, self.timeouts.control)

    # ---- state (idempotent GETs, retried) ---------------------------------------------------------------
    async def get_weight_version(self) -> str:
        """From `/model_info`: SGLang 0.5.9 answers `/get_weight_version` with a 404 pointing there."""
        return str((await self._get("/model_info"))["weight_version"])

    async def get_model_info(self) -> dict[str, Any]:
        return await self._get("/get_model_info")

    async def get_server_info(self) -> dict[str, Any]:
        return await self._get("/get_server_info")

    async def get_load(self) -> list[dict[str, Any]]:
        return await self._get("/get_load")

    async def health(self) -> bool:
        return await self._probe("/health")

    async def health_generate(self) -> bool:
        return await self._probe("/health_generate")

    # ---- transport ---------------------------------------------------------------------------------------
    async def _post(
        self, path: str, body: dict[str, Any], timeout: float, headers: dict | None = None, spread: bool = False,
    ) -> Any:
        """POSTs are never retried: generation and control calls are not idempotent in general. `spread`:
        a generation (httpx: from the next pool in turn)."""
        try:
            if spread and isinstance(self._wire, HttpxWire):
                response = await self._wire.request("POST", path, body, timeout, headers, spread=True)
            else:
                response = await self._wire.request("POST", path, body, timeout, headers)
        except (WireTimeout, WireError) as exc:
            raise EngineError(self.base_url + path, None, str(exc)) from exc
        return json_or_raise(response, self.base_url + path)

    async def _get(self, path: str) -> Any:
        delay, last = 0.2, None
        for attempt in range(self.get_retries + 1):
            try:
                response = await self._wire.request("GET", path, None, self.timeouts.control)
            except WireError as exc:
                last = EngineError(self.base_url + path, None, str(exc))
            except WireTimeout as exc:  # a GET answered late is retried like one not answered
                last = EngineError(self.base_url + path, None, str(exc))
            else:
                if response.status_code not in (502, 503, 504):
                    return json_or_raise(response, self.base_url + path)
                last = EngineError(self.base_url + path, response.status_code, error_message(response))
            if attempt < self.get_retries:
                await asyncio.sleep(delay)
                delay *= 2
        raise last  # type: ignore[misc]

    async def _probe(self, path: str) -> bool:
        try:
            response = await self._wire.request("GET", path, None, self.timeouts.control)
        except (WireTimeout, WireError):
            return False
        return response.status_code == 200
