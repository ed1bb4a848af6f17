"""The diffusion engine's HTTP server: SGLang's routes as a thin FastAPI adapter over `ImageRunner`, with the
text engine's weight routes, error replies and serving. `/generate` takes a class description and returns
images (`verst.inference_client.images`); `python -m verst.engine.diffusion_server --model DIR --port P`
(or `verst diffusion serve ...`) serves a denoiser saved by `verst.models.diffusion.save`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from verst.engine.app import add_core_routes, add_health_routes, install_error_handlers, parse_cores, serve
from verst.engine.diffusion_core import DiffusionCore, ImageJob, ImageRunner
from verst.engine.schema import ERROR_RESPONSES
from verst.engine.weight_routes import add_weight_routes
from verst.inference_client.images import SETTINGS, ImageGenerateRequest, ImageSamplingParams
from verst.inference_client.ports import listening_socket
from verst.inference_client.protocol import AbortRequest, PauseRequest
from verst.models import diffusion
from verst.types.arrays import encode_array
from verst.types.cores import CoreShare, take_share

log = logging.getLogger(__name__)
ENGINE_VERSION = "verst-diffusion-0.1"


@dataclasses.dataclass
class DiffusionState:
    """What the routes share (the weight routes' `WeightServer`)."""

    runner: ImageRunner
    model_path: str
    host: str = "127.0.0.1"
    port: int = 0
    weight_groups: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def core(self) -> DiffusionCore:
        return self.runner.core

    @property
    def on_cuda(self) -> bool:
        return False  # the sampler draws its noise on the CPU


def create_app(state: DiffusionState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await asyncio.to_thread(state.runner.stop)

    app = FastAPI(title="verst diffusion engine", version=ENGINE_VERSION, lifespan=lifespan,
                  responses=ERROR_RESPONSES)
    install_error_handlers(app)
    _add_generate_route(app, state)
    _add_info_routes(app, state)
    _add_control_routes(app, state)
    add_weight_routes(app, state)
    add_core_routes(app, state.runner)
    return app


def _add_generate_route(app: FastAPI, state: DiffusionState) -> None:
    @app.post("/generate")
    async def generate(body: ImageGenerateRequest) -> Response:
        job = state.core.job(body, body.rid or uuid.uuid4().hex)
        version, trajectories = await state.runner.generate(job)
        replies = [_image_reply(job, i, traj, version) for i, traj in enumerate(trajectories)]
        return JSONResponse(replies[0] if len(replies) == 1 else replies)


def _image_reply(job: ImageJob, i: int, traj: diffusion.Trajectory | None, version: str) -> dict[str, Any]:
    """SGLang's reply shape for one image: `image` (3, H, W) and `meta_info`; with `return_logprob`, the
    latents (steps + 1, 3, H, W) and each step's log-probability (a mean over the latent's elements)."""
    p = job.params
    meta: dict[str, Any] = {
        "id": job.rid if p.n == 1 else f"{job.rid}-{i}", "weight_version": version, "seed": job.seed + i,
        "num_inference_steps": p.num_inference_steps, "guidance_scale": p.guidance_scale,
        "noise_level": p.noise_level, "label": job.label,
        "finish_reason": {"type": "stop"} if traj is not None else {"type": "abort", "message": job.aborted},
    }
    if traj is not None and job.return_logprob:
        meta["latents"] = encode_array(traj.latents[0].numpy())
        meta["step_logprobs"] = traj.logprobs[0].tolist()
    image = encode_array(traj.images[0].numpy()) if traj is not None else None
    return {"text": "", "image": image, "meta_info": meta}


def _add_info_routes(app: FastAPI, state: DiffusionState) -> None:
    add_health_routes(app, state.runner, stopped="the engine is stopping",
                      bad_output="the model produced non-finite latents")

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        config = state.core.model.config
        return {
            "model_path": state.model_path, "tokenizer_path": None, "is_generation": True,
            "weight_version": state.core.weight_version, "architectures": [type(state.core.model).__name__],
            "sample_size": config.sample_size, "num_classes": state.core.n_classes,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        runner = state.runner
        return {
            "engine": "verst-diffusion", "version": ENGINE_VERSION, "host": state.host, "port": state.port,
            "model_path": state.model_path, "weight_version": state.core.weight_version, "dp_size": 1,
            "tp_size": 1, "paused": runner.paused, "torch_threads": runner.torch_threads,
            "busy_seconds": runner.busy_seconds, "uptime_seconds": time.monotonic() - runner.started_at,
            "internal_states": [dict(state.core.counters, pending=len(state.core.pending()))],
        }


def _add_control_routes(app: FastAPI, state: DiffusionState) -> None:
    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        return {"success": True, "message": "Nothing to flush: no state outlives a request."}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        n = state.core.abort_all() if body.abort_all else state.core.abort(body.rid)
        return {"success": True, "aborted": n}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseRequest | None = None) -> dict[str, Any]:
        mode = (body or PauseRequest()).mode
        n = state.runner.pause(mode)
        return {"success": True, "message": f"Generation paused ({mode}).", "mode": mode, "num_paused_requests": n}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        state.runner.resume()
        return {"success": True, "message": "Generation continued."}


def build_parser(prog: str = "python -m verst.engine.diffusion_server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a diffusers denoiser (verst.models.diffusion) over HTTP.")
    p.add_argument("--model", required=True, help="a denoiser directory in diffusers' format")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=30000, help="port; 0 picks a free one (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--weight-version", default="0", help="version string of the loaded weights")
    p.add_argument("--seed", type=int, default=0, help="seed for requests without sampling_seed")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads of the sampler")
    p.add_argument("--device", default="cpu", choices=("cpu",), help="where the sampler runs (the CPU only)")
    p.add_argument("--cpu-cores", default=None, metavar="IDS",
                   help="the CPUs to compute on, e.g. 0,1 (with --torch-threads threads); default: any")
    defaults = ImageSamplingParams()
    p.add_argument("--num-inference-steps", type=int, default=defaults.num_inference_steps,
                   help="SDE steps of a request that names none (every request through sglang-router)")
    p.add_argument("--guidance-scale", type=float, default=defaults.guidance_scale,
                   help="classifier-free guidance of a request that names none")
    p.add_argument("--noise-level", type=float, default=defaults.noise_level,
                   help="the SDE's noise level of a request that names none")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(*(prog,) if prog else ()).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = ImageSamplingParams(num_inference_steps=args.num_inference_steps,
                                       guidance_scale=args.guidance_scale, noise_level=args.noise_level)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise SystemExit(f"--{str(error['loc'][0]).replace('_', '-')} = {error['input']!r}: {error['msg']}") from None
    if args.cpu_cores:
        take_share(CoreShare(parse_cores(args.cpu_cores), args.torch_threads))
    core = DiffusionCore(diffusion.load(args.model), weight_version=args.weight_version, seed=args.seed,
                         settings=settings.model_dump(include=set(SETTINGS)))
    sock = listening_socket(args.host, args.port)
    port = sock.getsockname()[1]
    state = DiffusionState(runner=ImageRunner(core, args.torch_threads), model_path=args.model,
                           host=args.host, port=port)
    log.info("serving %s on http://%s:%d", os.path.normpath(args.model), args.host, port)
    serve(create_app(state), sock, args.port_file, args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
