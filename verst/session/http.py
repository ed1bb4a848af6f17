"""The session server's HTTP face: a thin FastAPI adapter over `SessionManager`, and `SessionServer`, which
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
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from verst.inference_client.ports import listening_socket
from verst.session.errors import SessionError
from verst.session.manager import SessionManager
from verst.session.openai_wire import model_card, parse_request
from verst.session.streaming import ChunkStream

logger = logging.getLogger(__name__)


def build_app(manager: SessionManager) -> FastAPI:
    app = FastAPI(title="verst session server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(SessionError)
    async def session_error(request: Request, exc: SessionError) -> JSONResponse:
        return JSONResponse(exc.to_openai(), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "sessions": len(manager)}

    @app.post("/sessions")
    async def create(request: Request) -> dict[str, str]:
        body = await _json(request, optional=True) or {}
        metadata = body.get("metadata") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(metadata, (dict, type(None))):
            raise SessionError(400, f"body must be {{\"metadata\": {{...}}}} or empty, got {body!r:.80}", "metadata")
        return {"session_id": manager.create(metadata)}

    @app.get("/sessions/{session_id}")
    async def get(session_id: str) -> dict[str, Any]:
        return manager.get(session_id)

    @app.delete("/sessions/{session_id}")
    async def delete(session_id: str) -> Response:
        manager.delete(session_id)
        return Response(status_code=204)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request) -> Response:
        body = await _json(request)
        if isinstance(body, dict) and body.get("stream") is True:
            return await _streamed_turn(manager, session_id, body)
        return _json_response(await manager.chat_completion(session_id, body))

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str) -> dict[str, Any]:
        manager.get(session_id)  # 404 for an unknown session, as every route under it
        return {"object": "list", "data": [model_card(manager.model_name, manager.created)]}

    @app.get("/sessions/{session_id}/v1/models/{model:path}")
    async def model(session_id: str, model: str) -> dict[str, Any]:
        manager.get(session_id)
        if model != manager.model_name:
            raise SessionError(404, f"model {model!r} is not served here; the session server serves "
                                    f"{manager.model_name!r}", "model")
        return model_card(manager.model_name, manager.created)

    @app.post("/sessions/{session_id}/samples")
    async def samples(session_id: str, request: Request) -> dict[str, Any]:
        body = await _json(request, optional=True) or {}
        max_tokens = body.get("max_tokens") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(max_tokens, (int, type(None))) or isinstance(max_tokens, bool):
            raise SessionError(400, f"body must be {{\"max_tokens\": int}} or empty, got {body!r:.80}", "max_tokens")
        return {"samples": [s.to_dict() for s in manager.samples(session_id, max_tokens=max_tokens)]}

    return app


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


def _json_response(payload: dict[str, Any]) -> Response:
    """A turn's reply, encoded by orjson (a reply with per-token logprobs runs to tens of kilobytes)."""
    return Response(orjson.dumps(payload), media_type="application/json")


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
