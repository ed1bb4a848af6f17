"""A stand-in for an SGLang 0.5.9 server, for running `cluster.engine = "sglang"` on machines without a GPU.

Every request is validated against SGLang's own request schema (`tests/contracts/sglang_schema.py`, read from
its io_struct.py), more strictly than SGLang itself: a field SGLang does not know is refused, where SGLang's
FastAPI layer would drop it silently. Replies have SGLang's shapes (`/abort_request` and the memory routes
answer an empty body or `null`, `/get_weight_version` a 404 pointing to `/model_info`, bad bodies a 400 in
SGLang's error shape). Generation, weight loads, pause, LoRA and memory release run on the embedded engine's
core, so logprobs are real. Tensor loads are unpickled with SGLang's own rules (its module allowlist).

Launched as SGLang is: `python -m sglang.launch_server --model-path M --host H --port P ...`, through a shim
package `sglang` that `mock_sglang_python(dir)` writes beside a wrapper Python. `VERST_SGLANG_MOCK_LOG`
names a JSON-lines file that records every request (path and body) the mock answered.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import pickle
import stat
import sys
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tests.contracts import sglang_schema as sg

REPO = Path(__file__).resolve().parents[1]
LOG_ENV = "VERST_SGLANG_MOCK_LOG"
# Routes SGLang serves without a request dataclass, and the one whose body is a bare BaseReq.
BARE = {**sg.BASE_REQ}
REQUEST_OF = {**sg.ROUTES, "/continue_generation": None, "/flush_cache": None}


# ---- validation against SGLang's schema -------------------------------------------------------------
class SchemaError(ValueError):
    """A body SGLang's request dataclass would not take; SGLang answers these 400."""


def check_body(path: str, body: Any) -> None:
    fields = sg.REQUESTS[REQUEST_OF[path]] if REQUEST_OF.get(path) else BARE
    if not isinstance(body, dict):
        raise SchemaError(f"{path}: the body must be a JSON object, got {type(body).__name__}")
    _check_fields(path, body, fields)
    params = body.get("sampling_params") if path == "/generate" else None
    for one in params if isinstance(params, list) else [params or {}]:  # a batch has one per prompt
        if not isinstance(one, dict):
            raise SchemaError(f"{path}: sampling_params must be objects, got {one!r}")
        _check_fields(f"{path} sampling_params", one, sg.SAMPLING_PARAMS, required=False)
    if path == "/pause_generation" and body.get("mode", "abort") not in sg.PAUSE_MODES:
        raise SchemaError(f"{path}: mode = {body['mode']!r} is not one of {sg.PAUSE_MODES}")
    bad_tags = [t for t in body.get("tags") or [] if t not in sg.MEMORY_TAGS] if "memory" in path else []
    if bad_tags:
        raise SchemaError(f"{path}: tags {bad_tags} are not among {sg.MEMORY_TAGS}")


def _check_fields(where: str, body: dict[str, Any], fields: dict[str, tuple], required: bool = True) -> None:
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise SchemaError(f"{where}: SGLang has no field(s) {unknown} (it would drop them without a word)")
    for key, value in body.items():
        kinds = fields[key][0] if isinstance(fields[key][0], tuple) else (fields[key][0],)
        kind = _json_type(value)
        if kind not in kinds and not (kind == "integer" and "number" in kinds):
            raise SchemaError(f"{where}: {key} = {value!r} is {kind}; SGLang takes {kinds}")
    missing = sorted(k for k, (_, default) in fields.items() if default == sg.REQUIRED and k not in body)
    if required and missing:
        raise SchemaError(f"{where}: missing required field(s) {missing}")


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}[type(value)]


def sglang_error(status: int, message: str) -> JSONResponse:
    """SGLang's ErrorResponse body (its validation and HTTP-exception handlers)."""
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request" if status == 400 else str(status),
                         "param": None, "code": status}, status_code=status)


# ---- SGLang's tensor unpickling -----------------------------------------------------------------------
class SGLangUnpickler(pickle.Unpickler):
    """SGLang's rules for `serialized_named_tensors`: globals only from its allowlisted module prefixes, never
    its denied callables."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in sg.UNPICKLE_DENIED or not any(
                (module + ".").startswith(prefix) for prefix in sg.UNPICKLE_MODULE_PREFIXES):
            raise SchemaError(f"serialized_named_tensors: SGLang blocks unpickling {module}.{name}")
        return super().find_class(module, name)


def sglang_named_tensors(entry: str) -> list:
    return SGLangUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()


# ---- the server ---------------------------------------------------------------------------------------
class MockSGLang:
    """The mock's routes over an embedded engine app (`verst.engine.server.create_app`), reached in-process."""

    def __init__(self, state: Any, args: argparse.Namespace):
        from verst.engine.server import create_app

        self.state, self.args = state, args
        self.engine = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://engine",
                                        timeout=600)
        self.log_path = os.environ.get(LOG_ENV)

    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            self.state.runner.start()  # the engine app's own lifespan does not run behind the ASGI transport
            try:
                yield
            finally:
                self.state.runner.stop()

        app = FastAPI(lifespan=lifespan)
        app.add_api_route("/{path:path}", self.handle, methods=["GET", "POST", "PUT"])
        return app

    async def handle(self, request: Request, path: str) -> Response:
        path = "/" + path
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return sglang_error(400, f"{path}: the body is not JSON")
        self._record(path, body)
        if path in ("/get_weight_version", "/weight_version"):
            return sglang_error(404, "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use "
                                "'/model_info' instead.")
        if request.method == "GET" and path in ("/health", "/health_generate", "/get_load"):
            return await self._forward("GET", path)
        if path in ("/model_info", "/get_model_info", "/get_server_info", "/server_info"):
            return await self._info(path)
        if path not in REQUEST_OF:
            return sglang_error(404, f"{path}: not a route this mock serves")
        try:
            check_body(path, body)
            return await self._post(path, body)
        except SchemaError as error:
            return sglang_error(400, str(error))

    async def _post(self, path: str, body: dict[str, Any]) -> Response:
        if path == "/update_weights_from_tensor":
            return await self._tensor_load(body)
        if path in ("/release_memory_occupation", "/resume_memory_occupation") and not self.args.enable_memory_saver:
            return JSONResponse({"error": {"message": f"{path} needs --enable-memory-saver"}}, status_code=400)
        if path.endswith("_lora_adapter") and not self.args.enable_lora:
            return JSONResponse({"success": False, "error_message": "LoRA is not enabled (--enable-lora)",
                                 "loaded_adapters": None}, status_code=400)
        if path == "/load_lora_adapter" and body["lora_name"] in self.state.core.loras.paths():
            return JSONResponse({"success": False, "error_message": f"LoRA adapter {body['lora_name']!r} is loaded "
                                 "already: SGLang loads a name once (unload it first)", "loaded_adapters": None},
                                status_code=400)
        forwarded = {k: v for k, v in body.items() if k not in ("rid", "http_worker_ipc") or path == "/generate"}
        reply = await self.engine.post(path, json=forwarded)
        return self._as_sglang(path, reply)

    def _as_sglang(self, path: str, reply: httpx.Response) -> Response:
        """The engine's reply in SGLang's shape for the route."""
        data = reply.json() if reply.content else None
        if reply.status_code >= 400:
            message = data["error"]["message"] if isinstance(data, dict) and "error" in data else reply.text
            if path.startswith(("/update_weights", "/init_weights", "/destroy_weights")):
                return JSONResponse({"success": False, "message": message}, status_code=400)
            if path.endswith("_lora_adapter"):  # SGLang's LoRAUpdateOutput
                return JSONResponse({"success": False, "error_message": message, "loaded_adapters": None},
                                    status_code=400)
            return JSONResponse({"error": {"message": message}}, status_code=400)
        if path == "/generate":
            for item in data if isinstance(data, list) else [data]:
                item["meta_info"].pop("oldest_weight_version", None)  # a verst engine's extension
            return JSONResponse(data)
        if path in ("/abort_request",):
            return Response(status_code=200)
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return JSONResponse(None)
        if path == "/flush_cache":
            return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are "
                                     "running or waiting requests, the operation will not be performed.)\n")
        if path in ("/pause_generation", "/continue_generation"):
            done = "paused" if path == "/pause_generation" else "continued"
            return JSONResponse({"message": f"Generation {done} successfully.", "status": "ok"})
        if path == "/update_weight_version":
            return JSONResponse({"success": True, "message": f"Weight version updated to {data['weight_version']}",
                                 "new_version": data["weight_version"]})
        if path == "/update_weights_from_disk":
            return JSONResponse({"success": True, "message": data["message"], "num_paused_requests": 0})
        if path.startswith(("/update_weights", "/init_weights", "/destroy_weights")):
            return JSONResponse({"success": True, "message": data["message"]})
        return JSONResponse(data)  # LoRA: SGLang's LoRAUpdateOutput, as the engine answers it

    async def _tensor_load(self, body: dict[str, Any]) -> Response:
        if body.get("load_format") is not None:
            raise SchemaError(f"load_format = {body['load_format']!r}: the mock loads SGLang's default format only")
        if len(body["serialized_named_tensors"]) != self.args.tp_size:
            raise SchemaError(f"serialized_named_tensors holds {len(body['serialized_named_tensors'])} entries for "
                              f"tp_size = {self.args.tp_size}: SGLang reads one per tensor-parallel rank")
        named = sglang_named_tensors(body["serialized_named_tensors"][0])
        version, flush = body.get("weight_version"), body.get("flush_cache", True)
        try:
            await self.state.runner.acall(lambda core: core.load_weights(named, version, flush=flush))
        except ValueError as error:
            return JSONResponse({"success": False, "message": str(error)}, status_code=400)
        return JSONResponse({"success": True, "message": "Succeeded to update model weights."})

    async def _info(self, path: str) -> Response:
        core = self.state.core
        if path in ("/model_info", "/get_model_info"):
            config = core.model.config
            return JSONResponse({
                "model_path": self.args.model_path, "tokenizer_path": self.args.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": core.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None), "architectures": getattr(config, "architectures", None)})
        stats = await self.state.runner.acall(lambda c: c.stats())
        return JSONResponse({
            "model_path": self.args.model_path, "host": self.args.host, "port": self.args.port, "tp_size": self.args.tp_size,
            "dp_size": 1, "weight_version": core.weight_version, "enable_memory_saver": self.args.enable_memory_saver,
            "enable_return_routed_experts": self.args.enable_return_routed_experts, "internal_states": [stats],
            "version": "0.5.9"})

    async def _forward(self, method: str, path: str) -> Response:
        reply = await self.engine.request(method, path)
        return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    def _record(self, path: str, body: Any) -> None:
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps({"path": path, "body": body}) + "\n")


# ---- launching it as `python -m sglang.launch_server` --------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang.launch_server (mock)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--weight-version", default="default")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # an unknown flag fails, as SGLang's parser does
    import torch
    import uvicorn

    from verst.engine.app import uvicorn_config
    from verst.engine.core import EngineConfig, EngineCore
    from verst.engine.runner import EngineRunner
    from verst.engine.server import listening_socket
    from verst.engine.service import ServerState
    from verst.models.loader import load_tokenizer
    from verst.models.native import load_causal_lm

    torch.set_num_threads(1)
    dtype = "float32" if args.dtype == "auto" else args.dtype
    model = load_causal_lm(args.model_path, "auto", dtype, args.device)
    config = EngineConfig(return_routed_experts=args.enable_return_routed_experts, max_loaded_loras=args.max_loras_per_batch)
    core = EngineCore(model, load_tokenizer(args.model_path), config, weight_version=args.weight_version)
    sock = listening_socket(args.host, args.port)
    state = ServerState(runner=EngineRunner(core), tokenizer=core.tokenizer, model_path=args.model_path,
                        served_model_name=os.path.basename(os.path.normpath(args.model_path)), host=args.host,
                        port=args.port)
    uvicorn.Server(uvicorn_config(MockSGLang(state, args).app())).run(sockets=[sock])
    return 0


def mock_sglang_python(directory: Path) -> str:
    """A Python for `cluster.engine_python` whose `sglang.launch_server` is this mock: a wrapper script that
    puts a shim package `sglang` and this checkout first on the path. Returns the script's path."""
    shim = directory / "shim" / "sglang"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text('"""The SGLang mock\'s shim (tests/sglang_mock.py)."""\n')
    (shim / "launch_server.py").write_text("import sys\n\nfrom tests.sglang_mock import main\n\nsys.exit(main())\n")
    python = directory / "python"
    python.write_text(f'#!/bin/sh\nexport PYTHONPATH="{shim.parent}:{REPO}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return str(python)


if __name__ == "__main__":
    sys.exit(main())
