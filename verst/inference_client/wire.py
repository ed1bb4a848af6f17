"""The HTTP under `EngineClient`: a request in, a `Reply` (status and body bytes) out, and two failures,
`WireTimeout` and `WireError` (no reply). `AiohttpWire` is the default: one connection pool with O(1) placement
and no per-request model objects; `HttpxWire` serves a caller that hands the client an httpx transport (tests'
mock and ASGI transports) and the streamed generations. Bodies are encoded and decoded with orjson.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator
from typing import Any, Literal

import aiohttp
import httpx
import orjson

from verst.inference_client.replies import transport_error_text

WireName = Literal["pooled", "aiohttp", "httpx"]
JSON_HEADERS = {"content-type": "application/json"}
# httpcore's pool scans every connection for every request it places, which costs O(n^2) at hundreds of
# concurrent generations: httpx requests are spread over several pools of at most this many connections.
CONNECTIONS_PER_POOL = 32
SWEPT_FROM_S, SWEEP_S = 30.0, 1.0  # aiohttp: requests allowed this long are timed out by a sweep this often


class WireTimeout(Exception):
    """No reply within the timeout."""


class WireError(Exception):
    """No reply: the connection failed or was lost. `refused`: nothing listened."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class Reply:
    """Status and body of one reply, read as `json_or_raise` and the error helpers read an httpx response."""

    __slots__ = ("status_code", "content")

    def __init__(self, status_code: int, content: bytes):
        self.status_code, self.content = status_code, content

    def json(self) -> Any:
        return orjson.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class SweptDeadlines:
    """Timeouts of long requests (generations) without a timer each: one sweep every `SWEEP_S` cancels the
    tasks past their deadline, and the request turns that cancel into `WireTimeout`. Thousands of generations
    in flight would otherwise keep as many timers in the loop's heap, each pushed and popped through
    Python-level comparisons. Deadlines of one timeout are kept in the order they were set, which is their
    order: a sweep stops at the first that is not due."""

    def __init__(self) -> None:
        self._by_timeout: dict[float, dict[asyncio.Task, float]] = {}
        self._expired: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    @contextlib.contextmanager
    def bound(self, timeout_s: float) -> Iterator[bool]:
        """Bounds the request made inside by `timeout_s` through the sweep when it is `SWEPT_FROM_S` or more
        (yields True: the caller sets no timer of its own), else yields False. A sweep's cancel leaves as
        `WireTimeout`; any other cancel goes on as it came."""
        if timeout_s < SWEPT_FROM_S:
            yield False
            return
        task = self._start(timeout_s)
        try:
            yield True
        except asyncio.CancelledError:
            if task not in self._expired:
                raise
            self._expired.discard(task)
            task.uncancel()
            raise WireTimeout(f"timed out after {timeout_s:g}s (swept)") from None
        finally:
            self._by_timeout.get(timeout_s, {}).pop(task, None)

    def _start(self, timeout_s: float) -> asyncio.Task:
        task = asyncio.current_task()
        assert task is not None
        self._by_timeout.setdefault(timeout_s, {})[task] = asyncio.get_running_loop().time() + timeout_s
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())
        return task

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while any(self._by_timeout.values()):
            await asyncio.sleep(SWEEP_S)
            now = loop.time()
            for deadlines in self._by_timeout.values():
                for task, deadline in deadlines.items():  # cancelling removes none of them here
                    if deadline > now:
                        break
                    if task not in self._expired:
                        self._expired.add(task)
                        task.cancel()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()


class AiohttpWire:
    """One aiohttp session per event loop (made at the first request in it), `max_connections` at most; a
    request allowed `SWEPT_FROM_S` or more is timed out by `SweptDeadlines`."""

    def __init__(self, base_url: str, max_connections: int, connect_timeout_s: float):
        self.base_url, self.max_connections, self.connect_timeout_s = base_url, max_connections, connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadlines = SweptDeadlines()

    def _open(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, ttl_dns_cache=None,
                                             enable_cleanup_closed=False)
            # no skip_auto_headers: naming any sorts them on every request
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
            self._loop = loop
        return self._session

    async def request(self, method: str, path: str, body: Any, timeout_s: float,
                      headers: dict[str, str] | None = None) -> Reply:
        session = self._open()
        data = orjson.dumps(body) if body is not None else None
        merged = {**JSON_HEADERS, **headers} if headers else JSON_HEADERS
        with self._deadlines.bound(timeout_s) as swept:
            # sock_connect bounds making a connection; waiting for a free one in the pool is bounded by the total only
            timeout = aiohttp.ClientTimeout(total=None if swept else timeout_s, sock_connect=self.connect_timeout_s)
            try:
                async with session.request(method, self.base_url + path, data=data, headers=merged,
                                           timeout=timeout) as response:
                    return Reply(response.status, await response.read())
            except aiohttp.ConnectionTimeoutError as exc:  # no connection made: the server is not there (now)
                raise WireError(f"ConnectError: no connection within {self.connect_timeout_s:g}s") from exc
            except asyncio.TimeoutError as exc:
                raise WireTimeout(f"timed out after {timeout_s:g}s ({type(exc).__name__})") from exc
            except aiohttp.ClientConnectorError as exc:
                raise WireError(transport_error_text(exc, "ConnectError"), refused=True) from exc
            except aiohttp.ClientError as exc:
                raise WireError(transport_error_text(exc)) from exc

    async def close(self) -> None:
        self._deadlines.close()
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None


class HttpxWire:
    """httpx pools of at most `CONNECTIONS_PER_POOL` connections, used in turn; `transport` is handed to each."""

    def __init__(self, base_url: str, max_connections: int, connect_timeout_s: float, control_timeout_s: float,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.base_url, self.transport = base_url, transport
        self.connect_timeout_s, self.control_timeout_s = connect_timeout_s, control_timeout_s
        self._per_pool = min(max_connections, CONNECTIONS_PER_POOL)
        self._pools: list[httpx.AsyncClient | None] = [None] * max(1, -(-max_connections // CONNECTIONS_PER_POOL))
        # one TLS context for all pools (loading the CA bundle costs ~0.1 s); none needed for plain http
        self._ssl = httpx.create_ssl_context() if base_url.startswith("https") else False
        self._next_pool = itertools.cycle(range(len(self._pools)))

    def pool(self, index: int | None = None) -> httpx.AsyncClient:
        """Pool `index` (the next in turn when None), made at first use."""
        index = next(self._next_pool) if index is None else index
        pool = self._pools[index]
        if pool is None:
            pool = self._pools[index] = httpx.AsyncClient(
                base_url=self.base_url, transport=self.transport, verify=self._ssl,
                timeout=httpx.Timeout(self.control_timeout_s, connect=self.connect_timeout_s),
                limits=httpx.Limits(max_connections=self._per_pool, max_keepalive_connections=self._per_pool),
            )
        return pool

    async def request(self, method: str, path: str, body: Any, timeout_s: float,
                      headers: dict[str, str] | None = None, spread: bool = False) -> Reply:
        """`spread`: from the next pool in turn (generations); else from the first (control calls)."""
        pool = self.pool(None if spread else 0)
        content = orjson.dumps(body) if body is not None else None
        merged = {**JSON_HEADERS, **headers} if headers else JSON_HEADERS
        try:
            response = await pool.request(method, path, content=content, headers=merged, timeout=timeout_s)
        except httpx.TimeoutException as exc:
            raise WireTimeout(f"timed out after {timeout_s:g}s ({type(exc).__name__})") from exc
        except httpx.ConnectError as exc:
            raise WireError(transport_error_text(exc, "ConnectError"), refused=True) from exc
        except httpx.TransportError as exc:
            raise WireError(transport_error_text(exc)) from exc
        return Reply(response.status_code, response.content)

    async def close(self) -> None:
        await asyncio.gather(*(pool.aclose() for pool in self._pools if pool is not None))
