"""HttpFanout: calls made at once (a health poll and a push's probe) each get their own connection to every
engine, and every reply comes from the engine it is filed under."""

from __future__ import annotations

import asyncio
import contextlib

from verst.inference_client.fanout import HttpFanout


async def _answer_with(name: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive HTTP/1.1 server whose every reply body is its name."""
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(name), name))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def engines(*names: str):
    servers = [await asyncio.start_server(lambda r, w, n=name.encode(): _answer_with(n, r, w), "127.0.0.1", 0)
               for name in names]
    try:
        yield [f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in servers]
    finally:
        for server in servers:
            server.close()


def test_calls_made_at_once_each_get_a_connection_and_the_right_replies():
    async def main():
        async with engines("a", "b", "c") as urls:
            fanout = HttpFanout(urls)
            try:
                first = await fanout.call_all("GET", "/health", None, 5.0)  # leaves one idle connection each
                assert {url: r.content for url, r in first.items()} == dict(zip(urls, [b"a", b"b", b"c"]))
                fanout._idle[urls[1]].clear()  # b's connection went away: the next calls open one while a's is idle
                calls = await asyncio.gather(*(fanout.call_all("GET", "/health", None, 5.0) for _ in range(3)))
                for replies in calls:
                    assert {url: r.content for url, r in replies.items()} == dict(zip(urls, [b"a", b"b", b"c"]))
                assert all(len(fanout._idle[url]) == 3 for url in urls)  # each call's connections kept for the next
            finally:
                await fanout.close()

    asyncio.run(main())


def test_an_idle_connection_closed_by_its_engine_is_replaced():
    async def main():
        async with engines("a", "b") as urls:
            fanout = HttpFanout(urls)
            try:
                await fanout.call_all("GET", "/health", None, 5.0)
                fanout._idle[urls[0]][0].close()  # the engine's side closed it while it was idle
                replies = await fanout.call_all("GET", "/health", None, 5.0)
                assert {url: r.content for url, r in replies.items()} == dict(zip(urls, [b"a", b"b"]))
            finally:
                await fanout.close()

    asyncio.run(main())
