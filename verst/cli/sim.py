"""`verst sim RECIPE`: an RL run on simulated engines and a simulated trainer (docs/scale.md)."""

from __future__ import annotations

import sys

from verst.cli.config_command import help_text
from verst.config import ConfigError

DESCRIPTION = ("An RL run with the real control plane (router, rollout manager, buffer, weight sync) on "
               "cluster.num_engines simulated engines and a simulated trainer; [sim] / --sim.FIELD set the "
               "simulation (docs/scale.md). Writes the run directory, its report and scale.json.")


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        from verst.sim.config import SimConfig

        print(help_text("sim", DESCRIPTION, resumes=False))
        print("\nsimulation fields (--sim.field VALUE):")
        for name, info in SimConfig.model_fields.items():
            print(f"  --sim.{name.replace('_', '-')}  (default: {info.default!r})\n      {info.description}")
        return 0
    from verst.sim.command import load_sim, run_sim

    args = list(argv)
    recipe = args.pop(0) if args and not args[0].startswith("--") else None
    try:
        cfg, sim = load_sim(recipe, args)
    except ConfigError as error:
        print(f"verst sim: {error}", file=sys.stderr)
        return 2
    run_sim(cfg, sim)
    return 0
