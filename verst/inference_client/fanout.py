"""One control call to every engine at once: the same request (pause, continue, flush, a weight bucket's load,
a version read) sent over one kept-alive connection per engine, its body encoded once. A weight push to a
thousand engines makes tens of thousands of these calls; a general HTTP client spends most of their cost on
objects made per request, which this path does not make.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import urlsplit

import httptools
import orjson

from verst.inference_client.wire import Reply, WireError, WireTimeout


class _Connection(asyncio.Protocol):
    """A kept-alive HTTP/1.1 connection; one request at a time (the caller waits for each reply)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiting: asyncio.Future | None = None
        self.body: list[bytes] = []
        self.keep_alive = True
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_exception(WireError(f"ServerDisconnectedError: {exc or 'the engine closed the connection'}"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.waiting is not None and not self.waiting.done():
                self.waiting.set_exception(WireError(f"unreadable reply: {exc}"))
            self.close()

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(Reply(self.parser.get_status_code(), b"".join(self.body)))

    def send(self, data: bytes) -> asyncio.Future:
        self.waiting = asyncio.get_running_loop().create_future()
        self.transport.write(data)  # type: ignore[union-attr]
        return self.waiting

    @property
    def usable(self) -> bool:
        return not self.lost and self.keep_alive and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class HttpFanout:
    """`await fanout.call_all("POST", "/pause_generation", body, timeout_s)`: every engine's `Reply`, or the
    `WireError`/`WireTimeout` of the ones that did not answer, by URL. Calls made at once each get a connection
    of their own; idle ones are kept for the next."""

    def __init__(self, urls: list[str], connect_timeout_s: float = 5.0):
        self.urls, self.connect_timeout_s = list(urls), connect_timeout_s
        self._hosts = {url: urlsplit(url) for url in self.urls}
        self._idle: dict[str, list[_Connection]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def call_all(self, method: str, path: str, body: Any, timeout_s: float) -> dict[str, Reply | Exception]:
        content = orjson.dumps(body) if body is not None else b""
        tail = (f"content-type: application/json\r\ncontent-length: {len(content)}\r\n\r\n").encode() + content
        line = f"{method} {path} HTTP/1.1\r\nhost: "
        deadline = time.monotonic() + timeout_s
        # Requests go out in one pass over kept connections (no task per engine); new connections open together.
        sent: dict[str, tuple[_Connection, asyncio.Future]] = {}
        opened = await asyncio.gather(*(self._open(url, deadline) for url in self.urls if not self._has_idle(url)),
                                      return_exceptions=True)
        fresh = {url: c for url, c in zip([u for u in self.urls if not self._has_idle(u)], opened)}
        results: dict[str, Reply | Exception] = {}
        for url in self.urls:
            connection = fresh[url] if url in fresh else self._idle[url].pop()
            if isinstance(connection, Exception):
                results[url] = connection
                continue
            sent[url] = (connection, connection.send(f"{line}{self._hosts[url].netloc}\r\n".encode() + tail))
        if sent:
            await asyncio.wait([future for _, future in sent.values()], timeout=max(deadline - time.monotonic(), 0.0))
        for url, (connection, future) in sent.items():
            if not future.done():
                future.cancel()
                connection.close()  # a reply coming later would answer the next call
                results[url] = WireTimeout(f"timed out after {timeout_s:g}s (ReadTimeout)")
            elif future.exception() is not None:
                results[url] = future.exception()
            else:
                results[url] = future.result()
                if connection.usable:
                    self._idle.setdefault(url, []).append(connection)
        return {url: results[url] for url in self.urls}

    def _has_idle(self, url: str) -> bool:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # connections belong to the loop that made them
            self._idle, self._loop = {}, loop
        idle = self._idle.get(url)
        while idle and not idle[-1].usable:
            idle.pop()
        return bool(idle)

    async def _open(self, url: str, deadline: float) -> _Connection:
        try:
            async with asyncio.timeout(min(self.connect_timeout_s, max(deadline - time.monotonic(), 0.0))):
                return await self._connection(url)
        except TimeoutError as exc:
            raise WireError(f"ConnectError: no connection within {self.connect_timeout_s:g}s") from exc

    async def _connection(self, url: str) -> _Connection:
        host = self._hosts[url]
        try:
            _, connection = await asyncio.get_running_loop().create_connection(_Connection, host.hostname, host.port)
        except (ConnectionError, OSError) as exc:
            raise WireError(f"ConnectError: {exc}", refused=True) from exc
        return connection

    async def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle = {}
