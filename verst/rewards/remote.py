"""A reward computed by an HTTP service: POST {prompt, response, label, metadata} -> {"reward": ...}.

Bounded concurrency and a whole-request deadline; every failure raises RewardError with the reason.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from verst.rewards.values import RewardError, RewardValue, check_reward_value
from verst.types import Sample


class RemoteReward:
    """An async reward fn backed by `url`; at most `max_concurrency` requests are in flight at once."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, max_concurrency: int = 32):
        if max_concurrency < 1:
            raise ValueError(f"RemoteReward: max_concurrency must be >= 1, got {max_concurrency}")
        self.url, self.timeout_s, self.max_concurrency = url, timeout_s, max_concurrency
        # The client and the semaphore belong to the event loop that first uses them, until aclose().
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, sample: Sample) -> RewardValue:
        client, slots = self._bind_loop()
        body = _request_body(sample)
        async with slots:
            try:
                # The deadline covers the whole exchange; waiting for a free slot does not count.
                async with asyncio.timeout(self.timeout_s):
                    reply = await client.post(self.url, content=body, headers={"content-type": "application/json"})
            except (TimeoutError, httpx.TimeoutException):
                raise RewardError(f"reward server {self.url}: no reply within {self.timeout_s} s") from None
            except httpx.HTTPError as e:
                raise RewardError(f"reward server {self.url}: {type(e).__name__}: {e}") from None
        if not reply.is_success:
            raise RewardError(f"reward server {self.url}: HTTP {reply.status_code}: {reply.text[:200]!r}")
        return parse_reply(reply.content, self.url)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        self._loop = self._client = self._slots = None

    def _bind_loop(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            self._client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
            self._slots = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop
        elif self._loop is not loop:
            # Its pooled connections belong to the first loop and cannot be used or closed from here.
            raise RuntimeError(
                f"RemoteReward({self.url}) is bound to another event loop; call aclose() in that loop first, "
                "or pass the RewardConfig to compute_rewards, which makes and closes a client per call"
            )
        assert self._client is not None and self._slots is not None
        return self._client, self._slots


def _request_body(sample: Sample) -> bytes:
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label, "metadata": sample.metadata}
    try:
        return json.dumps(payload).encode()
    except (TypeError, ValueError) as e:
        raise RewardError(f"sample {sample.index}: request is not JSON-serialisable ({e})") from None


def parse_reply(content: bytes, url: str) -> RewardValue:
    """The reward of a reply body `{"reward": float | {name: float}}`; anything else is a RewardError."""
    try:
        reply = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RewardError(f"reward server {url}: reply is not JSON ({e}): {content[:200]!r}") from None
    if not isinstance(reply, dict) or "reward" not in reply:
        raise RewardError(f"reward server {url}: reply has no 'reward' key: {content[:200]!r}")
    return check_reward_value(reply["reward"], f"reward server {url}")
