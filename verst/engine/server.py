"""The engine's HTTP server: SGLang's native endpoints as a thin FastAPI adapter over `EngineRunner`.

`python -m verst.engine.server --model DIR --port P` (or `verst serve engine ...`) serves one engine,
bound to 127.0.0.1 unless told otherwise. OpenAI-compatible routes are added from `openai_api.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from verst.engine.app import add_core_routes, add_health_routes, install_error_handlers, parse_cores, serve
from verst.engine.config import IMPLS
from verst.engine.http_errors import json_body, json_response, validated
from verst.engine.memory import release_memory, resume_memory
from verst.engine.request import generate_reply
from verst.engine.schema import ERROR_RESPONSES, install_openapi
from verst.engine.service import (
    ServerState,
    build_request,
    run_all_to_completion,
)
from verst.engine.weight_routes import add_lora_routes, add_weight_routes
from verst.inference_client.ports import listening_socket
from verst.inference_client.protocol import (
    AbortRequest,
    BatchGenerateRequest,
    GenerateRequest,
    InvalidRequest,
    PauseRequest,
    is_batch,
)
from verst.inference_client.weight_protocol import (
    MemoryOccupationRequest,
)
from verst.monitor.stacks import arm_stack_dump
from verst.types.cores import CoreShare, take_share, usable_cores

log = logging.getLogger(__name__)
ENGINE_VERSION = "verst-engine-0.1"


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.runner.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.runner.stop)

    app = FastAPI(title="verst engine", version=ENGINE_VERSION, lifespan=lifespan, responses=ERROR_RESPONSES)
    app.state.engine = state
    install_error_handlers(app)
    _add_generate_routes(app, state)
    _add_info_routes(app, state)
    _add_control_routes(app, state)
    add_weight_routes(app, state)
    add_core_routes(app, state.runner)
    add_lora_routes(app, state)
    from verst.engine.openai_api import add_openai_routes

    add_openai_routes(app, state)
    install_openapi(app, state.core.vocab_size, state.core.context_length)
    return app


def _add_generate_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        raw = await json_body(request)
        batch = is_batch(raw)
        body = validated(BatchGenerateRequest if batch else GenerateRequest, raw)
        # Every prompt of a batch (every sample of n) is validated before any is scheduled: a bad one fails the
        # request whole.
        many = batch or body.sampling_params.n > 1
        reqs = [_engine_request(state, one) for one in (body.prompts() if batch else body.samples())]
        text_fn = state.token_text if body.return_text_in_logprobs else None
        if body.stream:
            return StreamingResponse(_stream(state, reqs[0], text_fn), media_type="text/event-stream")
        done = await run_all_to_completion(state, reqs, request.is_disconnected)
        if done is None:
            return Response(status_code=499)
        replies = [generate_reply(req, req.text or "", return_text=text_fn) for req in done]
        return json_response(replies if many else replies[0])



def _engine_request(state: ServerState, body: GenerateRequest):
    """The engine request of a single-prompt /generate body."""
    ids = body.input_ids if body.input_ids is not None else state.encode(body.text or "")
    return build_request(
        state, ids, body.sampling_params, rid=body.rid,
        return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num or 0,
        return_routed_experts=body.return_routed_experts, priority=body.priority or 0, lora_path=body.lora_path,
        logprob_start_len=body.logprob_start_len,
    )


async def _stream(state: ServerState, req, text_fn):
    async for n in state.runner.stream(req):
        final = req.finished and n == len(req.output_ids)
        text = req.text if final else state.decode(req.output_ids[:n], req.sampling.skip_special_tokens)
        yield b"data: " + orjson.dumps(generate_reply(req, text or "", n, return_text=text_fn)) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    add_health_routes(app, state.runner, stopped="the engine thread is not running",
                      bad_output="the model produced non-finite logits")

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        core = state.core
        return {
            "model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
            "served_model_name": state.served_model_name, "weight_version": core.weight_version,
            "architectures": getattr(core.model.config, "architectures", None), "vocab_size": core.vocab_size,
            "context_length": core.context_length, "num_layers": core.runner.num_layers,
            "moe_layers": core.runner.moe_layers, "moe_top_k": core.runner.moe_top_k,
            "eos_token_ids": sorted(core.eos_ids),
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        stats = await state.runner.acall(lambda core: core.stats())
        config = state.core.config
        return {
            "engine": "verst", "version": ENGINE_VERSION, "host": state.host, "port": state.port,
            "model_path": state.model_path, "served_model_name": state.served_model_name,
            "context_length": state.core.context_length, "max_running_requests": config.max_running_requests,
            "max_prefill_tokens": config.max_prefill_tokens, "prefix_cache_tokens": config.prefix_cache_tokens,
            "return_routed_experts": config.return_routed_experts, "dp_size": 1, "tp_size": 1,
            "weight_version": stats["weight_version"], "step_errors": state.runner.step_errors,
            "busy_seconds": state.runner.busy_seconds, "max_loaded_loras": config.max_loaded_loras,
            "loaded_loras": stats["loaded_loras"], "torch_threads": state.runner.torch_threads,
            "cpu_cores": list(usable_cores()),
            "uptime_seconds": time.monotonic() - state.runner.started_at,
            "internal_states": [stats],
        }

    @app.get("/get_load")
    async def get_load() -> list[dict[str, float]]:
        """SGLang's GetLoadReqOutput per data-parallel rank (one here); ts_tic is when it was taken."""
        return [{**await state.runner.acall(lambda core: core.load()), "ts_tic": time.time()}]


def _add_control_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        await state.runner.acall(lambda core: core.flush_cache())
        return {"success": True, "message": "Cache flushed."}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        if body.abort_all:
            n = await state.runner.acall(lambda core: core.abort_all())
        else:
            n = int(await state.runner.acall(lambda core: core.abort(body.rid)))
        return {"success": True, "aborted": n}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseRequest | None = None) -> dict[str, Any]:
        mode = (body or PauseRequest()).mode
        n = await state.runner.acall(lambda core: core.pause(mode))
        return {"success": True, "message": f"Generation paused ({mode}).", "mode": mode, "num_paused_requests": n}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        await state.runner.acall(lambda core: core.resume())
        return {"success": True, "message": "Generation continued."}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(body: MemoryOccupationRequest | None = None) -> dict[str, Any]:
        tags = (body or MemoryOccupationRequest()).tags
        freed = await state.runner.acall(lambda core: release_memory(core, tags))
        return {"success": True, "message": f"Released {', '.join(freed)}.", "freed_bytes": freed}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(body: MemoryOccupationRequest | None = None) -> dict[str, Any]:
        tags = (body or MemoryOccupationRequest()).tags
        resumed = await state.runner.acall(lambda core: resume_memory(core, tags))
        return {"success": True, "message": f"Resumed {', '.join(resumed) or 'nothing'}."}



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verst serve engine", description="Serve one embedded inference engine over HTTP.")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=30000, help="port; 0 picks a free one (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--prefix-cache-tokens", type=int, default=32768, help="0 disables prefix caching")
    p.add_argument("--weight-version", default="0", help="version string of the loaded weights")
    p.add_argument("--return-routed-experts", action="store_true",
                   help="MoE: put routed experts in every reply (sglang-router drops the per-request field)")
    p.add_argument("--true-on-policy", action="store_true",
                   help="report each output's logprobs from the trainer's forward over the whole sequence alone "
                        "(bitwise equal to the trainer's; native model, float32, CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests without sampling_seed")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads of the forward (CPU)")
    p.add_argument("--cpu-cores", default=None, metavar="IDS",
                   help="comma-separated CPU ids every thread of the server runs on (default: where it was started)")
    p.add_argument("--disable-priority-preemption", action="store_true",
                   help="a waiting request of a higher priority waits for free slots instead of retracting "
                   "running lower-priority ones")
    p.add_argument("--model-impl", default="auto", choices=IMPLS,
                   help="the model's forward: verst's native one (dense Llama-family; the model is then built "
                   "without transformers), transformers', or auto (native where it applies)")
    p.add_argument("--check-native", action="store_true",
                   help="with the native model (built without transformers), compare its logits with transformers' "
                   "model of the same checkpoint at start-up and refuse to serve when they differ (adds seconds to start-up)")
    p.add_argument("--max-loaded-loras", type=int, default=8,
                   help="LoRA adapters resident at once (loaded with /load_lora_adapter or --lora-paths)")
    p.add_argument("--lora-paths", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT LoRA adapter directories to serve from the start, each under NAME")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    arm_stack_dump()  # SIGUSR1 prints every thread's stack into the engine's log (hang reports)
    import torch

    from verst.engine.core import EngineConfig, EngineCore
    from verst.engine.runner import EngineRunner
    from verst.models.loader import check_vocab, load_model, load_tokenizer
    from verst.models.native import NativeCausalLM, load_causal_lm

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("verst").setLevel(min(logging.INFO, logging.getLevelName(args.log_level.upper())))
    if args.cpu_cores:
        take_share(CoreShare(parse_cores(args.cpu_cores), args.torch_threads))
    else:
        torch.set_num_threads(args.torch_threads)
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    model = load_causal_lm(args.model, args.model_impl, args.dtype, args.device, args.trust_remote_code)
    check_vocab(tokenizer, model)
    if args.check_native and isinstance(model, NativeCausalLM):
        from verst.engine.model_runner import check_native_model

        diff = check_native_model(model, load_model(args.model, args.dtype, args.device))
        log.info("native model checked against transformers': max |logit difference| %.1e", diff)
    config = EngineConfig(
        max_running_requests=args.max_running_requests, max_prefill_tokens=args.max_prefill_tokens,
        context_length=args.context_length, prefix_cache_tokens=args.prefix_cache_tokens,
        return_routed_experts=args.return_routed_experts, seed=args.seed, model_impl=args.model_impl,
        priority_preemption=not args.disable_priority_preemption, max_loaded_loras=args.max_loaded_loras,
        true_on_policy=args.true_on_policy,
    )
    core = EngineCore(model, tokenizer, config, weight_version=args.weight_version)
    for spec in args.lora_paths:
        name, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"--lora-paths {spec!r}: give NAME=PATH")
        try:
            core.add_lora(core.read_lora(name, path))
        except InvalidRequest as exc:
            raise SystemExit(f"--lora-paths {spec!r}: {exc}") from None
    if args.return_routed_experts and not core.runner.moe_layers:
        raise SystemExit(f"--return-routed-experts: the model at {args.model} has no MoE router")
    sock = listening_socket(args.host, args.port)
    port = sock.getsockname()[1]
    state = ServerState(
        runner=EngineRunner(core, torch_threads=args.torch_threads), tokenizer=tokenizer, model_path=args.model,
        served_model_name=args.served_model_name or os.path.basename(os.path.normpath(args.model)),
        host=args.host, port=port,
    )
    log.info("serving %s on http://%s:%d", args.model, args.host, port)
    serve(create_app(state), sock, args.port_file, args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
