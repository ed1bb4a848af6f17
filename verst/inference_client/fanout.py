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

import orjson

from verst.inference_client.connection import KeptConnection, open_connection, request_head
from verst.inference_client.wire import Reply, WireTimeout


class HttpFanout:
    """`await fanout.call_all("POST", "/pause_generation", body, timeout_s)`: every engine's `Reply`, or the
    `WireError`/`WireTimeout` of the ones that did not answer, by URL. Calls made at once each get a connection
    of their own; idle ones are kept for the next."""

    def __init__(self, urls: list[str], connect_timeout_s: float = 5.0):
        self.urls, self.connect_timeout_s = list(urls), connect_timeout_s
        self._hosts = {url: urlsplit(url) for url in self.urls}
        self._idle: dict[str, list[KeptConnection]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def call_all(self, method: str, path: str, body: Any, timeout_s: float) -> dict[str, Reply | Exception]:
        content = orjson.dumps(body) if body is not None else b""
        deadline = time.monotonic() + timeout_s
        # Requests go out in one pass over kept connections (no task per engine); new connections open together.
        sent: dict[str, tuple[KeptConnection, asyncio.Future]] = {}
        connections = await self._connections(deadline)
        results: dict[str, Reply | Exception] = {}
        for url in self.urls:
            connection = connections[url]
            if isinstance(connection, Exception):
                results[url] = connection
                continue
            head = request_head(method, path, self._hosts[url].netloc, len(content))
            sent[url] = (connection, connection.send(head + content))
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

    async def _connections(self, deadline: float) -> dict[str, KeptConnection | Exception]:
        """A connection per engine for this call: its idle ones taken before anything is awaited (a call made
        meanwhile cannot take them too), new ones opened together for the others, and again for a taken one that
        closed while they opened. An engine that could not be reached has the error instead."""
        taken = {url: self._idle[url].pop() for url in self.urls if self._has_idle(url)}
        missing = [url for url in self.urls if url not in taken]
        opened = await asyncio.gather(*(self._open(url, deadline) for url in missing), return_exceptions=True)
        connections = {**taken, **dict(zip(missing, opened, strict=True))}
        closed = [url for url, connection in taken.items() if not connection.usable]
        if closed:
            reopened = await asyncio.gather(*(self._open(url, deadline) for url in closed), return_exceptions=True)
            connections.update(zip(closed, reopened, strict=True))
        return connections

    def _has_idle(self, url: str) -> bool:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # connections belong to the loop that made them
            self._idle, self._loop = {}, loop
        idle = self._idle.get(url)
        while idle and not idle[-1].usable:
            idle.pop()
        return bool(idle)

    async def _open(self, url: str, deadline: float) -> KeptConnection:
        host = self._hosts[url]
        return await open_connection(host.hostname, host.port,
                                     min(self.connect_timeout_s, max(deadline - time.monotonic(), 0.0)))

    async def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle = {}
