"""What every engine server's FastAPI app shares: the error handlers (SGLang's error body naming the field),
the health routes, how the app is served (uvicorn on a socket bound first), and the port file a launcher waits
for.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from verst.engine.http_errors import http_error, validation_error
from verst.engine.schema import UNHEALTHY
from verst.engine.service import error_response, invalid_request_response
from verst.inference_client.protocol import InvalidRequest
from verst.inference_client.weight_protocol import SetCoresRequest
from verst.monitor.heap import settle_heap
from verst.types.cores import CoreShare, take_share

HEALTH_PROBE_TIMEOUT_S = 20.0


def install_error_handlers(app: FastAPI) -> None:
    """422 for a body that breaks the schema, 400 for `InvalidRequest`, FastAPI's own errors in the same body."""
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(InvalidRequest, lambda request, exc: invalid_request_response(exc))
    app.add_exception_handler(HTTPException, http_error)


def add_health_routes(app: FastAPI, runner: Any, *, stopped: str, bad_output: str) -> None:
    """`/health`: 200 while `runner` (its `alive()`) runs, else 503 `stopped`. `/health_generate`: 200 when the
    core's `probe()`, run on the engine's thread within `HEALTH_PROBE_TIMEOUT_S`, says the model's output is
    finite, else 503 (`bad_output`, or why the probe failed)."""

    @app.get("/health", response_class=Response, responses=UNHEALTHY)
    async def health() -> Response:
        return Response(status_code=200) if runner.alive() else error_response(503, stopped)

    @app.get("/health_generate", response_class=Response, responses=UNHEALTHY)
    async def health_generate() -> Response:
        try:
            ok = await asyncio.wait_for(runner.acall(lambda core: core.probe()), HEALTH_PROBE_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError) as exc:
            return error_response(503, f"generation probe failed: {type(exc).__name__}: {exc}")
        return Response(status_code=200) if ok else error_response(503, bad_output)


def uvicorn_config(app: FastAPI, log_level: str = "warning") -> Any:
    """How the engine's app is served: uvloop and httptools, whose request handling costs a fraction of
    asyncio's loop and h11's parser (a weight sync's control calls are a few small requests each)."""
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, loop="uvloop", http="httptools", timeout_keep_alive=30,
                          timeout_graceful_shutdown=5)


def serve(app: FastAPI, sock: socket.socket, port_file: str | None, log_level: str = "warning") -> None:
    """Serve `app` on the bound socket until stopped (the server's process: its start-up heap settled first,
    `verst.monitor.heap`); the port goes to `port_file` (atomically) first."""
    import uvicorn

    settle_heap(owned=True)
    server = uvicorn.Server(uvicorn_config(app, log_level))
    if port_file:
        tmp = f"{port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(sock.getsockname()[1]))
        os.replace(tmp, port_file)
    server.run(sockets=[sock])


def add_core_routes(app: FastAPI, runner: Any) -> None:
    """`POST /set_cores` (verst's, on CPU): the cores the engine computes on from now on and its torch threads,
    taken on the runner's thread (`runner.acall`; torch's thread count is the calling thread's)."""

    @app.post("/set_cores")
    async def set_cores(body: SetCoresRequest) -> dict[str, Any]:
        share = CoreShare(tuple(sorted(set(body.cores))), body.threads)
        if share.cores[-1] >= (os.cpu_count() or 1):
            raise InvalidRequest("cores", body.cores, f"this machine has CPUs 0-{(os.cpu_count() or 1) - 1}")
        try:
            await runner.acall(lambda core: take_share(share))
        except OSError as exc:  # a core this machine does not have, or one the process may not use
            raise InvalidRequest("cores", body.cores, f"cannot run there: {exc.strerror}") from None
        runner.torch_threads = share.threads
        return {"success": True, "cores": list(share.cores), "threads": share.threads}


def parse_cores(text: str) -> tuple[int, ...]:
    """`--cpu-cores`: "0,1,4" -> (0, 1, 4)."""
    try:
        cores = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise SystemExit(f"--cpu-cores {text!r}: give comma-separated CPU ids, e.g. 0,1") from None
    if not cores or min(cores) < 0:
        raise SystemExit(f"--cpu-cores {text!r}: give comma-separated CPU ids, e.g. 0,1")
    return cores
