"""`verst serve`: run a server standalone.

    verst serve engine --model DIR [--port P] [...]          one embedded inference engine (SGLang dialect)
    verst serve router --engine URL [--engine URL ...] [...]  sglang-router in front of running engines
    verst serve session --engine-url URL --model DIR [...]    the token-in-token-out session server
                        [--lora-path NAME=DIR]                (every turn sampling with a LoRA adapter)
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

USAGE = __doc__.split("\n", 2)[2]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: verst serve {engine,router,session} [--help]\n\n" + USAGE)
        return 0
    what, rest = argv[0], argv[1:]
    if what == "engine":
        from verst.engine.server import main as serve_engine

        return serve_engine(rest)
    if what == "router":
        return _serve_router(rest)
    if what == "session":
        return _serve_session(rest)
    print(f"verst serve: unknown server {what!r}; choices: engine, router, session", file=sys.stderr)
    return 2


def _serve_router(argv: list[str]) -> int:
    from verst.router.manager import ASSIGNMENT_MODES, POLICIES, RouterManager

    p = argparse.ArgumentParser(prog="verst serve router", description="sglang-router in front of running engines.")
    p.add_argument("--engine", action="append", default=[], help="engine URL (repeat for several)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--policy", default="manual", choices=POLICIES)
    p.add_argument("--assignment-mode", default="min_load", choices=ASSIGNMENT_MODES)
    args = p.parse_args(argv)
    router = RouterManager(args.engine, policy=args.policy, assignment_mode=args.assignment_mode,
                           host=args.host, port=args.port)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    with router:
        print(f"sglang-router on {router.url} in front of {', '.join(args.engine) or 'no engines yet'}", flush=True)
        try:
            while not stop["now"] and router.proc is not None and router.proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


def _serve_session(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="verst serve session",
                                description="The token-in-token-out session server in front of an engine or router.")
    p.add_argument("--engine-url", required=True, help="engine or sglang-router base URL")
    p.add_argument("--model", required=True, help="checkpoint directory whose tokenizer and chat template to use")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=0, help="default: a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--max-context-tokens", type=int, default=None, help="cap on prompt + response of a session")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per-turn default when a request names none")
    p.add_argument("--context-length", type=int, default=None,
                   help="the model's context, to refuse requests beyond it (default: as the engine reports it)")
    p.add_argument("--lora-path", default=None, metavar="NAME[=DIR]",
                   help="every turn samples with this LoRA adapter: NAME=DIR loads the PEFT adapter directory DIR "
                        "into the engine under NAME first; NAME alone names one the engine serves already")
    args = p.parse_args(argv)
    import asyncio
    import os

    from verst.inference_client.client import EngineClient
    from verst.models.loader import load_tokenizer
    from verst.session.http import SessionServer
    from verst.session.manager import SessionManager

    tokenizer = load_tokenizer(args.model)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with EngineClient(args.engine_url) as control:
            adapter = await session_adapter(control, args.lora_path)
        async with EngineClient(args.engine_url, lora_path=adapter) as engine:
            manager = SessionManager(engine, tokenizer, max_context_tokens=args.max_context_tokens,
                                     max_new_tokens=args.max_new_tokens, context_length=args.context_length,
                                     model_name=os.path.basename(os.path.normpath(args.model)))
            async with SessionServer(manager, host=args.host, port=args.port) as server:
                if args.port_file:
                    with open(f"{args.port_file}.tmp", "w") as f:
                        f.write(str(server.port))
                    os.replace(f"{args.port_file}.tmp", args.port_file)
                print(f"verst session server on {server.url} in front of {args.engine_url}", file=sys.stderr,
                      flush=True)
                await stop.wait()

    asyncio.run(serve())
    return 0


async def session_adapter(engine: Any, spec: str | None) -> str | None:
    """`--lora-path NAME=DIR`: load DIR into the engine under NAME; `NAME`: check that the engine serves it.
    Returns the name every turn's generation names (None: the base). A refusal names the option."""
    if spec is None:
        return None
    name, _, directory = spec.partition("=")
    if not name:
        raise ValueError(f"--lora-path {spec!r}: give NAME=DIR (an adapter directory) or NAME (a loaded adapter)")
    if directory:
        try:
            await engine.load_lora_adapter(name, str(Path(directory).resolve()))
        except Exception as error:
            raise ValueError(f"--lora-path {spec!r}: the engine refused the adapter: {error}") from None
        return name
    loaded = [lora["lora_name"] for lora in (await engine.get_server_info()).get("loaded_loras", [])]
    if name not in loaded:
        raise ValueError(f"--lora-path {name!r}: the engine serves no adapter of that name; it serves {loaded} "
                         "(give NAME=DIR to load one)")
    return name
