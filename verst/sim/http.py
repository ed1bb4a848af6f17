"""A small HTTP/1.1 server on asyncio and httptools for the simulated fleet: keep-alive connections, JSON
bodies, one handler per path. A thousand engines listen in one process, so a request must cost tens of
microseconds here (a web framework costs milliseconds), and a client that drops its connection cancels
its handler, which is how an engine learns that a generation was abandoned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
import orjson

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any] | None, dict[str, str]], Awaitable[tuple[int, Any]]]
"""`handler(json_body_or_None, headers) -> (status, payload)`; payload bytes are sent as they are."""
REASONS = {200: "OK", 204: "No Content", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           422: "Unprocessable Entity", 500: "Internal Server Error", 503: "Service Unavailable"}


def error(status: int, message: str, field: str | None = None) -> tuple[int, dict[str, Any]]:
    """SGLang's error body, with the offending field where there is one."""
    body: dict[str, Any] = {"message": message, "code": status,
                            "type": "BadRequestError" if status < 500 else "InternalError"}
    if field is not None:
        body["field"] = field
    return status, {"error": body}


class Routes:
    """Handlers by path; `gate`, when set, is awaited before any handler runs (a stalled engine's)."""

    def __init__(self, handlers: dict[str, Handler], gate: Callable[[], Awaitable[None]] | None = None):
        self.handlers, self.gate = handlers, gate

    async def handle(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
        handler = self.handlers.get(path)
        if handler is None:
            return error(404, f"no route {path}")
        if self.gate is not None:
            await self.gate()
        try:
            parsed = orjson.loads(body) if body else None
        except orjson.JSONDecodeError as exc:
            return error(400, f"the body is not JSON: {exc}")
        return await handler(parsed, headers)


class HttpConnection(asyncio.Protocol):
    """One client connection; requests on it are answered in order."""

    def __init__(self, routes: Routes, connections: set[HttpConnection]):
        self.routes, self.connections = routes, connections
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.headers: dict[str, str] = {}
        self.tasks: set[asyncio.Task] = set()
        self.queue: asyncio.Queue | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        for task in self.tasks:
            task.cancel()  # a generation whose client left ends on the engine too

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._send(400, {"error": {"message": f"bad HTTP request: {exc}"}}, keep_alive=False)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.body, self.headers = b"", [], {}

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path = self.url.split(b"?", 1)[0].decode("latin-1")
        task = asyncio.get_running_loop().create_task(
            self._answer(path, b"".join(self.body), self.headers, self.parser.should_keep_alive(), self.tasks.copy()))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, path: str, body: bytes, headers: dict[str, str], keep_alive: bool,
                      before: set[asyncio.Task]) -> None:
        try:
            status, payload = await self.routes.handle(path, body, headers)
        except Exception as exc:  # a handler's bug answers 500 with its message instead of hanging the client
            log.exception("sim HTTP handler for %s failed", path)
            status, payload = error(500, f"{type(exc).__name__}: {exc}")
        if before:  # replies leave in request order
            await asyncio.gather(*before, return_exceptions=True)
        self._send(status, payload, keep_alive)

    def _send(self, status: int, payload: Any, keep_alive: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        data = payload if isinstance(payload, bytes) else orjson.dumps(payload) if payload is not None else b""
        close = "" if keep_alive else "connection: close\r\n"
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n{close}\r\n")
        self.transport.write(head.encode("latin-1") + data)
        if not keep_alive:
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection at once (the engine behind it died)."""
        if self.transport is not None:
            self.transport.abort()


class HttpServer:
    """`await HttpServer(routes).start(host, port)`; `stop()` closes the socket and drops every connection."""

    def __init__(self, routes: Routes):
        self.routes = routes
        self.connections: set[HttpConnection] = set()
        self.server: asyncio.base_events.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: HttpConnection(self.routes, self.connections), host, port,
                                               reuse_address=True, backlog=4096)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for connection in list(self.connections):
            connection.abort()
