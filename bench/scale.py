"""The control plane at scale, on simulated engines (docs/scale.md). Subcommands:

    client  the engine client's CPU per /generate through sglang-router to N simulated engines, per client variant
            (`before`: the client at main before this work; `httpx`, `aiohttp`: today's wires)
    run     a `verst sim` run at N engines and K trajectories in flight per engine: control-plane CPU per trajectory
            (per agentic turn with --turns), engine utilisation, weight pushes, driver memory, accounting

Every figure comes with the machine's load average; repeat runs (--repeats) give the spread.

    .venv/bin/python bench/scale.py client [--engines 1024] [--requests 20000] [--concurrency 1000] [--repeats 3]
    .venv/bin/python bench/scale.py run --engines 64 --in-flight 64 [--turns 0] [--schedule fully_async] ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._scale_client import run_client_probe  # noqa: E402


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def client(args: argparse.Namespace) -> dict:
    out = run_client_probe(args.engines, args.requests, args.concurrency, args.reply_tokens, args.variants,
                           args.repeats)
    print(f"{args.engines} engines, {args.requests} requests at {args.concurrency} concurrent, "
          f"{args.reply_tokens} tokens per reply (median [min-max] of {args.repeats})")
    print(f"{'client':10} {'req/s':>22} {'client ms':>22} {'router ms':>22} {'fleet ms':>22} {'load':>16}")
    for variant, runs in out["results"].items():
        cols = [spread([r[k] for r in runs]) for k in ("requests_per_s", "client_ms", "router_ms", "fleet_ms",
                                                      "load_average")]
        print(f"{variant:10} " + " ".join(f"{c:>22}" for c in cols))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("client")
    p.add_argument("--engines", type=int, default=1024)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=1000)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--variants", nargs="+", default=["before", "httpx", "aiohttp"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = parser.parse_args(argv)
    result = {"client": client}[args.command](args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
