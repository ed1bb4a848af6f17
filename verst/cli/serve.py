"""`verst serve`: run a server standalone.

    verst serve engine --model DIR [--port P] [...]          one embedded inference engine (SGLang dialect)
    verst serve router --engine URL [--engine URL ...] [...]  sglang-router in front of running engines
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

USAGE = __doc__.split("\n", 2)[2]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: verst serve {engine,router} [--help]\n\n" + USAGE)
        return 0
    what, rest = argv[0], argv[1:]
    if what == "engine":
        from verst.engine.server import main as serve_engine

        return serve_engine(rest)
    if what == "router":
        return _serve_router(rest)
    print(f"verst serve: unknown server {what!r}; choices: engine, router", file=sys.stderr)
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
