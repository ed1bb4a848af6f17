"""A kept-alive HTTP/1.1 client connection on asyncio and httptools, one request at a time, and its opening: what
the fan-out of control calls and the pooled generate path are made of (no object per request beyond a future)."""

from __future__ import annotations

import asyncio

import httptools

from verst.inference_client.replies import transport_error_text
from verst.inference_client.wire import Reply, WireError


class KeptConnection(asyncio.Protocol):
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
        content, self.body = b"".join(self.body), []  # a kept connection holds no reply after handing it on
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(Reply(self.parser.get_status_code(), content))

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


async def open_connection(host: str, port: int, connect_timeout_s: float) -> KeptConnection:
    """A new connection, or `WireError` (`refused` when nothing listens)."""
    try:
        async with asyncio.timeout(connect_timeout_s):
            _, connection = await asyncio.get_running_loop().create_connection(KeptConnection, host, port)
    except (ConnectionError, OSError) as exc:
        raise WireError(transport_error_text(exc, "ConnectError"), refused=True) from exc
    except TimeoutError as exc:
        raise WireError(f"ConnectError: no connection within {connect_timeout_s:g}s") from exc
    return connection


def request_head(method: str, path: str, netloc: str, content_length: int, headers: dict[str, str] | None = None) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
    return (f"{method} {path} HTTP/1.1\r\nhost: {netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {content_length}\r\n{extra}\r\n").encode("latin-1")
