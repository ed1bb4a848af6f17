"""The `pooled` wire: requests to one base URL (the router, or one engine) over kept HTTP/1.1 connections made
on asyncio and httptools, at most `max_connections` at once. A generation costs a request's bytes, a future and
its reply's parse: no client objects per request, which a general client makes at every call."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import orjson

from verst.inference_client.connection import KeptConnection, open_connection, request_head
from verst.inference_client.wire import Reply, SweptDeadlines, WireError, WireTimeout


class PooledWire:
    def __init__(self, base_url: str, max_connections: int, connect_timeout_s: float):
        self.base_url, self.max_connections, self.connect_timeout_s = base_url, max_connections, connect_timeout_s
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"the pooled wire speaks plain http, and {base_url!r} is {parts.scheme}")
        self._host, self._port, self._netloc = parts.hostname, parts.port or 80, parts.netloc
        self._idle: list[KeptConnection] = []
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadlines = SweptDeadlines()

    def _for_loop(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # connections and the semaphore belong to the loop that made them
            self._idle, self._slots, self._loop = [], asyncio.Semaphore(self.max_connections), loop
        return self._slots  # type: ignore[return-value]

    async def request(self, method: str, path: str, body: Any, timeout_s: float,
                      headers: dict[str, str] | None = None) -> Reply:
        connection: KeptConnection | None = None
        reply: Reply | None = None
        try:
            with self._deadlines.bound(timeout_s) as swept:
                async with self._for_loop(), asyncio.timeout(None if swept else timeout_s):
                    connection = await self._connection()
                    # encoded once a connection is held, and not kept while the reply is awaited
                    reply = await connection.send(self._encode(method, path, body, headers))
        except TimeoutError as exc:
            raise WireTimeout(f"timed out after {timeout_s:g}s (ReadTimeout)") from exc
        finally:
            if connection is not None and reply is None:  # a reply coming later would answer the next request;
                connection.close()  # closed, the engine also ends a generation whose caller went away
        if connection.usable:
            self._idle.append(connection)
        return reply

    def _encode(self, method: str, path: str, body: Any, headers: dict[str, str] | None) -> bytes:
        """The request's bytes: its head and JSON body in one buffer (orjson's own, which reserves far more than
        the body, is freed at once)."""
        content = orjson.dumps(body) if body is not None else b""
        return request_head(method, path, self._netloc, len(content), headers) + content

    async def _connection(self) -> KeptConnection:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable:
                return connection
        return await open_connection(self._host, self._port, self.connect_timeout_s)

    async def close(self) -> None:
        self._deadlines.close()
        for connection in self._idle:
            connection.close()
        self._idle = []


__all__ = ["PooledWire", "WireError"]
