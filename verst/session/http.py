"""The session server's HTTP face: a thin Starlette adapter over `SessionManager`, and `SessionServer`, which
serves it with uvicorn as a task of the current event loop on a pre-bound loopback socket.

Routes: POST /sessions, GET|DELETE /sessions/{id}, POST /sessions/{id}/v1/chat/completions and
GET /sessions/{id}/v1/models[/{model}] (OpenAI), POST /sessions/{id}/samples, GET /health. Errors are
OpenAI error bodies with the manager's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from verst.inference_client.ports import listening_socket
from verst.session.errors import SessionError
from verst.session.manager import SessionManager
from verst.session.openai_wire import model_card, parse_request
from verst.session.streaming import ChunkStream

logger = logging.getLogger(__name__)


def build_app(manager: SessionManager) -> Starlette:
    """The routes as a plain Starlette app: every reply is JSON that orjson encodes, and nothing between the
    socket and the manager parses or validates what the manager checks itself."""

    async def health(request: Request) -> Response:
        return _json_response({"status": "ok", "sessions": len(manager)})

    async def create(request: Request) -> Response:
        body = await _json(request, optional=True) or {}
        metadata = body.get("metadata") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(metadata, (dict, type(None))):
            raise SessionError(400, f"body must be {{\"metadata\": {{...}}}} or empty, got {body!r:.80}", "metadata")
        return _json_response({"session_id": manager.create(metadata)})

    async def session(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        if request.method == "DELETE":
            manager.delete(session_id)
            return Response(status_code=204)
        return _json_response(manager.get(session_id))

    async def chat_completions(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        body = await _json(request)
        if isinstance(body, dict) and body.get("stream") is True:
            return await _streamed_turn(manager, session_id, body)
        return _json_response(await manager.chat_completion(session_id, body))

    async def models(request: Request) -> Response:
        manager.get(request.path_params["session_id"])  # 404 for an unknown session, as every route under it
        return _json_response({"object": "list", "data": [model_card(manager.model_name, manager.created)]})

    async def model(request: Request) -> Response:
        manager.get(request.path_params["session_id"])
        name = request.path_params["model"]
        if name != manager.model_name:
            raise SessionError(404, f"model {name!r} is not served here; the session server serves "
                                    f"{manager.model_name!r}", "model")
        return _json_response(model_card(manager.model_name, manager.created))

    async def samples(request: Request) -> Response:
        body = await _json(request, optional=True) or {}
        max_tokens = body.get("max_tokens") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(max_tokens, (int, type(None))) or isinstance(max_tokens, bool):
            raise SessionError(400, f"body must be {{\"max_tokens\": int}} or empty, got {body!r:.80}", "max_tokens")
        sid = request.path_params["session_id"]
        return _json_response({"samples": [s.to_dict() for s in manager.samples(sid, max_tokens=max_tokens)]})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/sessions", create, methods=["POST"]),
        Route("/sessions/{session_id}", session, methods=["GET", "DELETE"]),
        Route("/sessions/{session_id}/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/sessions/{session_id}/v1/models", models, methods=["GET"]),
        Route("/sessions/{session_id}/v1/models/{model:path}", model, methods=["GET"]),
        Route("/sessions/{session_id}/samples", samples, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={SessionError: _session_error, HTTPException: _http_error})


async def _session_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SessionError)
    return _json_response(exc.to_openai(), exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    """An unknown path (404) or method (405), in OpenAI's error body as every other refusal."""
    assert isinstance(exc, HTTPException)
    what = "path" if exc.status_code == 404 else "method"
    error = SessionError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", what)
    return _json_response(error.to_openai(), exc.status_code, exc.headers)


async def _streamed_turn(manager: SessionManager, session_id: str, body: dict[str, Any]) -> Response:
    """The turn runs as a task that streams from the engine; the reply is an event stream once the first
    tokens come (a turn refused before any is answered with its error status, as unstreamed). A client
    that goes away mid-stream does not stop the turn: it is recorded, and a resend rolls it back."""
    req = parse_request(body)  # a malformed request is refused before the turn starts
    stream = ChunkStream(manager.tokenizer, model=req.model or manager.model_name, parse_tools=req.parse_tools,
                         logprobs=req.logprobs, include_usage=req.include_usage, token_texts=manager.token_texts)
    updates: asyncio.Queue = asyncio.Queue()
    turn = asyncio.create_task(manager.chat_completion(session_id, body, on_tokens=updates.put_nowait))
    turn.add_done_callback(lambda task: (updates.put_nowait(None), task.cancelled() or task.exception()))
    first = await updates.get()
    if first is None:
        turn.result()  # raises what refused the turn

    async def events():
        partial = first
        while partial is not None:
            for event in stream.update(f"chatcmpl-{partial.rid or session_id}", partial.output_ids, partial.logprobs):
                yield event
            partial = await updates.get()
        try:
            reply = turn.result()
        except SessionError as exc:
            for event in stream.error(exc):
                yield event
            return
        for event in stream.finish(reply):
            yield event

    return StreamingResponse(events(), media_type="text/event-stream")


async def _json(request: Request, optional: bool = False) -> Any:
    raw = await request.body()
    if not raw and optional:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SessionError(400, f"body: invalid JSON ({exc})", "body") from None


def _json_response(payload: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A reply encoded by orjson (a turn's reply with per-token logprobs runs to tens of kilobytes)."""
    return Response(orjson.dumps(payload), status, headers, media_type="application/json")


class _TaskServer(uvicorn.Server):
    """uvicorn's Server minus its signal capture: a server inside someone else's event loop must leave
    that process's SIGINT/SIGTERM handling alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class SessionServer:
    """`async with SessionServer(manager) as server: server.url ...` — the app on `host:port` (0: a free
    port), served by a task of the running loop until `stop()`."""

    def __init__(self, manager: SessionManager, host: str = "127.0.0.1", port: int = 0):
        self.manager, self.host, self.port = manager, host, port
        self.url: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop serving it, once started
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._starting: asyncio.Lock | None = None

    async def start(self) -> str:
        """Bind, serve, and return the base URL once the server accepts requests (idempotent)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._task is not None:
                return self.url  # type: ignore[return-value]
            sock = listening_socket(self.host, self.port)
            self.port = sock.getsockname()[1]
            config = uvicorn.Config(build_app(self.manager), log_config=None, log_level="warning", access_log=False,
                                    lifespan="off", timeout_keep_alive=30, timeout_graceful_shutdown=5)
            self._server = _TaskServer(config)
            self.loop = asyncio.get_running_loop()
            self._task = self.loop.create_task(self._server.serve(sockets=[sock]))
            while not self._server.started:
                if self._task.done():
                    sock.close()
                    self._task.result()  # raises what stopped it
                    raise RuntimeError(f"session server on {self.host}:{self.port} stopped during start-up")
                await asyncio.sleep(0.01)
            self.url = f"http://{self.host}:{self.port}"
            return self.url

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=10)
        except TimeoutError:
            logger.warning("session server %s did not stop in 10 s; cancelling it", self.url)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def aclose(self) -> None:
        await self.stop()

    async def __aenter__(self) -> SessionServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
