"""The `verst` command: dispatches `verst <command> ...` to one module per command.

Command modules import torch lazily, so `--help` and `--dry-run` stay fast and torch-free.
"""

from __future__ import annotations

import importlib
import os
import sys

from verst.monitor.logs import configure_logging

COMMANDS = {
    "model": ("verst.cli.model", "make a model locally: verst model init --arch qwen3 --size tiny --out DIR"),
    "diffusion": ("verst.cli.diffusion", "the shapes denoiser: verst diffusion pretrain --out DIR; ... rl ..."),
    "data": ("verst.cli.data", "write a procedural task: verst data make addition --n 2000 --out DIR"),
    "sft": ("verst.cli.sft", "supervised fine-tuning: verst sft RECIPE [--section.field VALUE ...]"),
    "train": ("verst.cli.train", "RL training: verst train RECIPE [--section.field VALUE ...]"),
    "sim": ("verst.cli.sim", "an RL run on simulated engines: verst sim RECIPE [--sim.field VALUE ...]"),
    "serve": ("verst.cli.serve", "run a server standalone: verst serve engine --model DIR --port P"),
    "eval": ("verst.cli.eval", "score a run's weights at one step later: verst eval RUN_DIR [--step N]"),
    "report": ("verst.cli.report", "HTML report of a run, or of runs overlaid: verst report RUN_DIR ..."),
    "config": ("verst.cli.config_docs", "the Markdown reference of every config field: verst config docs"),
}


def usage() -> str:
    lines = ["usage: verst <command> [args]  (verst <command> --help for details)", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"verst: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # Recipes name plug-ins by import path ("examples.calculator.agent:run"); as with `python -m`, they
    # resolve from the working directory, which a console script does not put on sys.path by itself.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    configure_logging()
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(argv[1:]) or 0)


def run() -> int:
    """The `verst` command's entry: `main` in a process of verst's own (`verst.monitor.heap.own_heap`)."""
    from verst.monitor.heap import own_heap

    own_heap()
    return main()


if __name__ == "__main__":
    sys.exit(run())
