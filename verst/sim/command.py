"""`verst sim`: a real RL run (any schedule, agentic turns included) on simulated engines and a simulated trainer.
The recipe is an ordinary one; its `[sim]` table and `--sim.field VALUE` set `SimConfig`, the other overrides the
run's config. The run writes the usual directory and report, and RUN/scale.json (`verst.sim.summary`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from verst.config import ConfigError, VerstConfig, load_config
from verst.config.load import parse_overrides, read_recipe
from verst.monitor.run_dir import run_dir_of
from verst.schedules.fully_async import run_fully_async
from verst.schedules.one_step_off import run_one_step_off
from verst.schedules.sync import run_sync
from verst.sim.config import SimConfig
from verst.sim.run import SCALE_FILE, open_sim_run
from verst.sim.setup import simulated_config
from verst.sim.summary import scale_lines

log = logging.getLogger(__name__)
LOOPS = {"sync": run_sync, "one_step_off": run_one_step_off, "fully_async": run_fully_async}
SIM_PREFIX = "sim."


def load_sim(recipe: str | None, argv: list[str]) -> tuple[VerstConfig, SimConfig]:
    """The run's config (simulated) and the simulation's settings from a recipe and `--field VALUE` overrides."""
    tree = read_recipe(recipe) if recipe is not None else {}
    table = dict(tree.pop("sim", {}) or {})
    sim_args, rest = split_sim_args(argv)
    for dotted, value in parse_overrides(sim_args):
        table[dotted[len(SIM_PREFIX):]] = value
    try:
        sim = SimConfig.model_validate(table)
    except ValidationError as error:
        lines = [f"sim.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})" for e in error.errors()]
        raise ConfigError("invalid sim settings:\n  " + "\n  ".join(lines)) from None
    cfg = load_config(None, rest, base=tree)
    if not Path(cfg.model.path, "tokenizer_config.json").is_file() and not Path(cfg.model.path, "tokenizer.json").is_file():
        raise ConfigError(f"model.path = {cfg.model.path!r} holds no tokenizer; the simulated rollout side tokenizes "
                          "with it (make one: verst model init --arch qwen3 --size tiny --out DIR)")
    return simulated_config(cfg, sim), sim


def split_sim_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`--sim.field VALUE` overrides, the others), each override with its value."""
    sim, rest = [], []
    i = 0
    while i < len(argv):
        takes_value = "=" not in argv[i] and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        group = argv[i:i + 2] if takes_value else argv[i:i + 1]
        (sim if argv[i].startswith("--" + SIM_PREFIX) else rest).extend(group)
        i += len(group)
    return sim, rest


def run_sim(cfg: VerstConfig, sim: SimConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the schedule's loop over `open_sim_run`: the run's summary and its scale summary."""
    loop = LOOPS[cfg.schedule]
    summary = asyncio.run(loop(cfg, 0, open_run=functools.partial(open_sim_run, sim=sim)))
    scale = json.loads((run_dir_of(cfg) / SCALE_FILE).read_text())
    for line in scale_lines(scale):
        log.info(line)
    return summary, scale
