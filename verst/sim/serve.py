"""One simulated engine as a server of its own, the way an engine actor starts one (`cluster.engine = "sim"`,
registered by `verst.sim.plugin`): `python -m verst.sim.serve --model DIR --host H --port P --port-file F`.
The latency model is `SimConfig`'s defaults (`--speedup` sets the clock)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import uvloop

from verst.engine_kinds.kinds import EngineKind
from verst.sim.config import SimConfig
from verst.sim.fleet import FleetSpec, serve

SIM = EngineKind("sim", ("-m", "verst.sim.serve"))
DEFAULT_VOCAB = 32000


def vocab_size(model: str) -> int:
    """The model directory's `vocab_size` (config.json), which bounds the sampled ids."""
    config = Path(model) / "config.json"
    return int(json.loads(config.read_text()).get("vocab_size", DEFAULT_VOCAB)) if config.is_file() else DEFAULT_VOCAB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verst.sim.serve", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", required=True)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--device", default="cpu", help="accepted as every engine kind is given it; nothing runs there")
    p.add_argument("--model-impl", default="auto", help="accepted as every engine kind is given it")
    args = p.parse_args(argv)
    sim = SimConfig(speedup=args.speedup)
    spec = FleetSpec(count=1, costs=sim.engine_costs_inputs(), speedup=sim.speedup, model_path=args.model,
                     vocab_size=vocab_size(args.model), response_tokens_mean=sim.response_tokens_mean,
                     response_tokens_sigma=sim.response_tokens_sigma, max_running=sim.max_running,
                     restart_s=sim.engine_restart_s, host=args.host, ports=(args.port,), version=args.weight_version)
    uvloop.run(serve(spec, Path(args.port_file), single=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
