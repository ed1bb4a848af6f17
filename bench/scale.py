"""The control plane at scale, on simulated engines (docs/scale.md). Subcommands:

    client  the engine client's CPU per /generate through sglang-router to N simulated engines, per client variant
            (`before`: the httpx client with sharded pools of commit 874016a, loaded from git; `pooled`,
            `aiohttp`, `httpx`: the wires of the client)
    run     a `verst sim` run at N engines and K trajectories in flight per engine: control-plane CPU per trajectory
            (per agentic turn with --turns), engine utilisation, weight pushes, driver memory and garbage
            collections, accounting; `--heap untouched` leaves the process's heap as it was (the baseline of
            `verst.monitor.heap`, which `verst sim` settles once the run has started)
    sync    one weight push at a time fanned out to N simulated engines by the real syncer: wall seconds beyond
            the modelled transfer
    memory  the rollout manager's memory per trajectory in flight, beyond its prompt's token ids (target <= 2 KB)

Every figure comes with the machine's load average; repeat runs (--repeats) give the spread.

    .venv/bin/python bench/scale.py client [--engines 1024] [--requests 20000] [--concurrency 1000] [--repeats 3]
    .venv/bin/python bench/scale.py run --engines 64 --in-flight 64 [--turns 0] [--schedule fully_async] ...
    .venv/bin/python bench/scale.py sync --engines 1024 [--total-params 8e9] [--bucket-bytes 536870912]
    .venv/bin/python bench/scale.py memory --engines 64 --in-flight 64 [--prompt-chars 64 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._scale_client import run_client_probe  # noqa: E402
from bench._scale_memory import measure_in_flight, per_trajectory  # noqa: E402
from bench._scale_run import model_dir, run_once, run_sync_fanout  # noqa: E402
from verst.config import SyncConfig  # noqa: E402
from verst.monitor.heap import own_heap  # noqa: E402

BUCKET_BYTES = SyncConfig().bucket_bytes  # sync.bucket_bytes's default
TARGET_BYTES_BEYOND_PROMPT = 2048  # docs/scale.md: rollout-manager memory per trajectory in flight, beyond token ids


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


def run(args: argparse.Namespace) -> dict:
    if args.heap == "settled":
        own_heap()  # this process runs what `verst sim` runs, and settles its heap as that command's does
    results = [run_once(args, repeat) for repeat in range(args.repeats)]
    keys = ("control_ms_per_trajectory", "control_ms_per_request", "engine_busy_fraction", "engine_paused_fraction",
            "engine_mean_batch",
            "stale_share", "wall_s")
    print(f"{args.engines} engines x {args.in_flight} in flight, {args.turns} agentic turns, one request per "
          f"{args.request_per}, speed-up {args.speedup}, heap {args.heap} (median [min-max] of {args.repeats})")
    for key in keys:
        print(f"  {key:28} {spread([r[key] for r in results])}")
    for part in ("driver", "rollout_manager", "router", "weight_sync", "fleet"):
        print(f"  cpu ms/request {part:13} {spread([r['cpu_ms_per_request'].get(part, 0.0) for r in results])}")
    sync = [r["sync"] for r in results if r["sync"]]
    if sync:
        print(f"  sync overhead s (median)     {spread([s['overhead_median_s'] for s in sync])}")
    print(f"  driver RSS peak MB           {spread([r['driver_rss_bytes']['peak'] / 2**20 for r in results])}")
    for gen in ("gen0", "gen1", "gen2"):  # the whole run, start-up included
        print(f"  gc {gen} collections, s      {spread([r['gc'].get(gen, {}).get('collections', 0) for r in results])}"
              f", {spread([r['gc'].get(gen, {}).get('seconds', 0.0) for r in results])}")
    print(f"  load average                 {[r['load_average'] for r in results]}")
    print(f"  accounting problems          {[r['accounting']['problems'] for r in results]}")
    return {"args": vars(args), "results": results}


def sync(args: argparse.Namespace) -> dict:
    out = run_sync_fanout(args.engines, args.total_params, args.bucket_bytes, args.pushes, args.speedup,
                          args.fleet_processes)
    rows = out["pushes"][1:]  # the first push opens every connection
    print(f"weight push to {args.engines} engines, {args.total_params:.3g} parameters in "
          f"{out['pushes'][0]['buckets']:.0f} buckets (median [min-max] of {len(rows)})")
    for key in ("seconds", "modelled_s", "overhead_s", "syncer_cpu_s", "fleet_cpu_s", "load_average"):
        print(f"  {key:14} {spread([r[key] for r in rows])}")
    return out


def memory(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="verst-scale-memory-")).resolve()
    in_flight = args.engines * args.in_flight
    points = [measure_in_flight(model_dir(work), work, args.engines, in_flight, chars, args.group_size, args.request_per)
              for chars in args.prompt_chars]
    line = per_trajectory(points)
    print(f"{args.engines} engines x {args.in_flight} in flight ({in_flight} trajectories, one request per "
          f"{args.request_per}), rollout manager's traced Python memory (load average {os.getloadavg()[0]:.1f})")
    for p in points:
        print(f"  prompt of {p['prompt_ids']:5d} ids: {p['bytes_per_trajectory']:9.0f} bytes per trajectory "
              f"(resident {p['rss_bytes_per_trajectory']:.0f}; all in flight after {p['settle_s']:.1f} s)")
    print(f"  per prompt id {line['bytes_per_prompt_id']:.1f} bytes; per trajectory beyond its prompt "
          f"{line['bytes_beyond_prompt']:.0f} bytes (target <= {TARGET_BYTES_BEYOND_PROMPT})")
    return {"args": vars(args), "points": points, **line}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("client")
    p.add_argument("--engines", type=int, default=1024)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=1000)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--variants", nargs="+", default=["before", "httpx", "aiohttp", "pooled"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    p = sub.add_parser("run")
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--in-flight", type=int, default=64, help="trajectories in flight per engine")
    p.add_argument("--turns", type=int, default=0, help="agentic turns per trajectory (0: single-turn)")
    p.add_argument("--env-seconds", type=float, default=5.0)
    p.add_argument("--schedule", default="fully_async")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps-per-flight", type=int, default=4, help="the in-flight trajectories feed this many steps")
    p.add_argument("--reply-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--trainer-gpus", type=int, default=64)
    p.add_argument("--fleet-processes", type=int, default=1)
    p.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES, help="sync.bucket_bytes")
    p.add_argument("--request-per", choices=["sample", "group"], default="sample", help="rollout.request_per")
    p.add_argument("--heap", choices=["settled", "untouched"], default="settled",
                   help="settled: as `verst sim` (verst.monitor.heap); untouched: the collector's defaults, the baseline")
    p.add_argument("--kill", type=float, default=0.0)
    p.add_argument("--stall", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--work-dir")
    p.add_argument("--out")
    p = sub.add_parser("sync")
    p.add_argument("--engines", type=int, default=1024)
    p.add_argument("--total-params", type=float, default=8e9)
    p.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES)
    p.add_argument("--pushes", type=int, default=4)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--fleet-processes", type=int, default=1)
    p.add_argument("--out")
    p = sub.add_parser("memory")
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--in-flight", type=int, default=64, help="trajectories in flight per engine")
    p.add_argument("--prompt-chars", type=int, nargs=2, default=[64, 1024], help="the two prompt lengths")
    p.add_argument("--request-per", choices=["sample", "group"], default="sample", help="rollout.request_per")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--work-dir")
    p.add_argument("--out")
    args = parser.parse_args(argv)
    result = {"client": client, "run": run, "sync": sync, "memory": memory}[args.command](args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
