"""Request batching for `EngineClient`: single-prompt /generate bodies that callers submit in the same
event-loop turn are sent as one batched /generate (SGLang's list form), and each caller gets its reply.

A rollout step starts a whole batch of samples at once; one HTTP request per group instead of one per
sample removes most of the per-request cost (HTTP, JSON, the server's validation) on a small model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

# The body fields that differ per prompt; every other field (flags) must be equal to share a request.
PER_PROMPT = ("input_ids", "text", "sampling_params", "rid", "lora_path")
Send = Callable[[dict[str, Any], dict[str, str] | None], Awaitable[Any]]


class BatchReplyError(RuntimeError):
    """The server answered a batch with something other than one reply per prompt."""


class RequestBatcher:
    """`await batcher.submit(body, headers)` returns the reply `send(body, headers)` would have.

    Bodies with the same headers and flags that arrive before the loop next runs the flush are sent
    together, at most `max_batch` per request. A 400 for a batch (one bad prompt) is retried prompt by
    prompt, so each caller gets its own answer; any other failure goes to every caller of the batch.
    A caller cancelled while waiting leaves the others waiting; the request itself is cancelled only
    when every caller is gone (the engine then aborts them, as for a single dropped request).
    """

    def __init__(self, send: Send, max_batch: int):
        if max_batch < 2:
            raise ValueError(f"RequestBatcher: max_batch must be >= 2, got {max_batch}")
        self._send, self.max_batch = send, max_batch
        self._pending: dict[tuple, list[tuple[dict[str, Any], asyncio.Future]]] = {}
        self.requests_sent = 0  # HTTP requests, for tests and benchmarks

    async def submit(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        ids, text = body.get("input_ids"), body.get("text")
        if isinstance(text, list) or ids and isinstance(ids[0], list):
            raise ValueError("RequestBatcher.submit takes single-prompt bodies, got a batch")
        key = _key(body, headers)
        future = asyncio.get_running_loop().create_future()
        waiting = self._pending.setdefault(key, [])
        waiting.append((body, future))
        if len(waiting) == 1:
            asyncio.get_running_loop().call_soon(self._flush, key, headers)
        elif len(waiting) >= self.max_batch:
            self._flush(key, headers)
        return await future

    def _flush(self, key: tuple, headers: dict[str, str] | None) -> None:
        waiting = self._pending.pop(key, [])
        waiting = [(body, future) for body, future in waiting if not future.done()]
        if waiting:
            asyncio.ensure_future(self._run(waiting, headers))

    async def _run(self, waiting: list[tuple[dict[str, Any], asyncio.Future]], headers: dict[str, str] | None) -> None:
        futures = [future for _, future in waiting]
        request = asyncio.ensure_future(self._send_batch([body for body, _ in waiting], headers))
        # Cancel the request once nobody waits for it (a single request is cancelled with its caller).
        for future in futures:
            future.add_done_callback(lambda _: all(f.cancelled() for f in futures) and request.cancel())
        try:
            replies = await request
        except asyncio.CancelledError:
            return
        except Exception as error:  # noqa: BLE001  handed to the callers
            if getattr(error, "status", None) != 400 or len(waiting) == 1:
                _fail(futures, error)  # the engine or the transport failed: every caller sees it
                return
            replies = await asyncio.gather(*(self._send_one(body, headers) for body, _ in waiting),
                                           return_exceptions=True)
        for future, reply in zip(futures, replies):
            if future.done():
                continue
            if isinstance(reply, BaseException):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _send_batch(self, bodies: list[dict[str, Any]], headers: dict[str, str] | None) -> list[Any]:
        if len(bodies) == 1:
            return [await self._send_one(bodies[0], headers)]
        batch = dict(bodies[0])
        for field in PER_PROMPT:
            if field in batch:
                batch[field] = [body.get(field) for body in bodies]
        self.requests_sent += 1
        replies = await self._send(batch, headers)
        if not isinstance(replies, list) or len(replies) != len(bodies):
            got = f"a list of {len(replies)}" if isinstance(replies, list) else type(replies).__name__
            raise BatchReplyError(f"/generate: a batch of {len(bodies)} prompts was answered with {got}")
        return replies

    async def _send_one(self, body: dict[str, Any], headers: dict[str, str] | None) -> Any:
        self.requests_sent += 1
        return await self._send(body, headers)


def _key(body: dict[str, Any], headers: dict[str, str] | None) -> tuple:
    flags = tuple(sorted((k, repr(v)) for k, v in body.items() if k not in PER_PROMPT))
    present = tuple(field in body for field in PER_PROMPT)  # a rid-less body cannot join rid'd ones
    return flags, present, tuple(sorted((headers or {}).items()))


def _fail(futures: list[asyncio.Future], error: BaseException) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error)
