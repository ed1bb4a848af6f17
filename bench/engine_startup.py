"""An embedded engine server's start-up: launch to serving (`EngineProcess`: the port bound and `/health` ok) on a
tiny model, wall seconds and the child's CPU seconds, as shipped and with a baseline measured in the same run.

The baseline is the same server started with `torch.distributed.tensor` imported first: what the engine paid
while the native model imported the sequence-parallel module at load (DTensor pulls in sympy and torch's
symbolic shapes). The two alternate, so a slow moment of a shared machine falls on both.

    .venv/bin/python bench/engine_startup.py [--repeats 5] [--model DIR] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._scale_run import model_dir  # noqa: E402
from verst.engine.process import EngineProcess  # noqa: E402
from verst.sim.measure import cpu_seconds  # noqa: E402

SHIPPED = ["-m", "verst.engine.server"]
WITH_DTENSOR = ["-c", "import runpy, torch.distributed.tensor; "
                      "runpy.run_module('verst.engine.server', run_name='__main__', alter_sys=True)"]
VARIANTS = {"shipped": SHIPPED, "with_dtensor": WITH_DTENSOR}


def start_once(model: Path, entry: list[str]) -> dict[str, float]:
    started = time.perf_counter()
    with EngineProcess(model, entry=entry) as engine:
        wall = time.perf_counter() - started
        assert engine.proc is not None
        cpu = cpu_seconds(engine.proc.pid)
    return {"wall_s": wall, "cpu_s": cpu}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", help="an HF checkpoint directory (default: a tiny Qwen3 made in a temp dir)")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats = {args.repeats} must be >= 1")
    model = Path(args.model) if args.model else model_dir(Path(tempfile.mkdtemp(prefix="verst-engine-startup-")))
    start_once(model, SHIPPED)  # warms the page cache for both
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, entry in VARIANTS.items():
            runs[name].append(start_once(model, entry))
    load = os.getloadavg()[0]
    print(f"engine server start-up, launch to serving, {model.name} (median [min-max] of {args.repeats}, "
          f"load average {load:.1f})")
    for name, rows in runs.items():
        print(f"  {name:13} wall {summary([r['wall_s'] for r in rows])} s   "
              f"child CPU {summary([r['cpu_s'] for r in rows])} s")
    shipped, base = (statistics.median(r["wall_s"] for r in runs[n]) for n in ("shipped", "with_dtensor"))
    print(f"  shipped / with_dtensor wall: {shipped / base:.2f}x ({base - shipped:+.2f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": str(model), "runs": runs, "load_average": load}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
