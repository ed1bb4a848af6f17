"""Shared argument handling of the config-driven commands (`verst sft`, `verst train`).

`verst CMD [RECIPE] [--dry-run] [--section.field VALUE ...]`; `--help` lists the config fields the command
reads with their type, default and doc line. The config's files are checked before anything starts (`preflight`).
Nothing here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection

from verst.config import ConfigError, VerstConfig, batch_plan, iter_fields, load_config


def help_text(prog: str, description: str, fields: Collection[str] | None = None, *, resumes: bool = True) -> str:
    """The command's help; its config fields are those named in `fields` (a field, or a section and all
    in it), or every field when None. `resumes`: the command takes --resume and --dry-run."""
    listed = "config fields" if fields is None else f"config fields verst {prog} reads"
    every = "" if fields is None else "; verst train --help lists every field"
    options = " [--resume RUN_DIR] [--dry-run]" if resumes else ""
    lines = [
        f"usage: verst {prog} [RECIPE.toml|.yaml]{options} [--section.field VALUE ...]",
        "",
        description,
        "",
        "options:",
        "  -h, --help     show this help and exit",
    ]
    if resumes:
        lines += [
            "  --dry-run      print the resolved config and batch arithmetic, check its files, then exit (no torch import)",
            "  --resume RUN_DIR  continue the run in RUN_DIR from its latest checkpoint; its config.yaml is the",
            "                 base unless a RECIPE is given (only logging, eval, checkpoint and step-count fields may change)",
        ]
    lines += [
        "  --overwrite    empty an existing run directory first (the config field `overwrite`); without it a",
        "                 run directory that holds files is refused",
        "",
        f"{listed} (--section.field VALUE; dashes and underscores are interchangeable{every}):",
    ]
    for dotted, type_name, default, doc in iter_fields():
        if fields is not None and not any(dotted == name or dotted.startswith(f"{name}.") for name in fields):
            continue
        lines.append(f"  --{dotted.replace('_', '-')} {type_name}  (default: {default!r})")
        lines.append(f"      {doc}")
    return "\n".join(lines)


def run_config_command(prog: str, argv: list[str], description: str, run: Callable[[VerstConfig], object],
                       *, rl: bool, fields: Collection[str] | None = None) -> int:
    """Parse, check the config's files (exit 2 naming each problem), then `run(cfg)` or, with
    `--dry-run`, print the resolved config and batch arithmetic. `--help` lists `fields` (see `help_text`)."""
    from verst.cli.preflight import PreflightError, preflight

    cfg, dry_run = parse_config_command(prog, argv, description, fields)
    if cfg is None:
        return 0
    if dry_run:
        print_dry_run(cfg)
    try:
        preflight(cfg, rl=rl)
    except PreflightError as error:
        print(f"verst {prog}: {error}", file=sys.stderr)
        return 2
    if not dry_run:
        return run_stoppable(prog, cfg, run)
    return 0


def run_stoppable(prog: str, cfg: VerstConfig, run: Callable[[VerstConfig], object]) -> int:
    """`run(cfg)` with SIGINT and SIGTERM handled alike (`verst.run.signals`): an interrupted run exits
    with 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM) after one line naming its latest
    checkpoint and the command that continues it; no traceback."""
    import asyncio
    import signal

    from verst.run.signals import STOP, StoppedBySignal, StopSignals

    with StopSignals():
        try:
            run(cfg)
        except (KeyboardInterrupt, asyncio.CancelledError, StoppedBySignal):
            signum = STOP.signum or signal.SIGINT
            print(interrupted_message(prog, cfg, signum.name), file=sys.stderr, flush=True)
            return 128 + int(signum)
    return 0


def interrupted_message(prog: str, cfg: VerstConfig, signal_name: str = "SIGINT") -> str:
    """What an interrupt leaves: the run's latest checkpoint and how to continue from it (no traceback)."""
    from verst.monitor.checkpoint_dirs import read_latest
    from verst.monitor.run_dir import run_dir_of

    run_dir = run_dir_of(cfg)
    latest = read_latest(run_dir) if run_dir.is_dir() else None
    if latest is None:
        return (f"verst {prog}: interrupted by {signal_name}; {run_dir} holds no checkpoint yet "
                f"(checkpoint.interval = {cfg.checkpoint.interval})")
    return (f"verst {prog}: interrupted by {signal_name}; latest checkpoint {latest}; "
            f"continue with: verst {prog} --resume {run_dir}")


def parse_config_command(prog: str, argv: list[str], description: str,
                         fields: Collection[str] | None = None) -> tuple[VerstConfig | None, bool]:
    """Return (config, dry_run); (None, False) after printing help. Exits 2 on a bad config."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(prog, description, fields))
        return None, False
    args = list(argv)
    dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    recipe = args.pop(0) if args and not args[0].startswith("--") else None
    try:
        recipe, args = _resume_args(recipe, args)
        cfg = load_config(recipe, args)
    except ConfigError as e:
        print(f"verst {prog}: {e}", file=sys.stderr)
        sys.exit(2)
    return cfg, dry_run


def _resume_args(recipe: str | None, args: list[str]) -> tuple[str | None, list[str]]:
    """`--resume RUN_DIR` becomes `--checkpoint.load RUN_DIR`, with the run's config.yaml as the base
    when no recipe is given."""
    if "--resume" not in args:
        return recipe, args
    at = args.index("--resume")
    if at + 1 >= len(args) or args[at + 1].startswith("--"):
        raise ConfigError("--resume needs a run directory")
    run_dir = args[at + 1]
    rest = args[:at] + args[at + 2:]
    if recipe is None:
        from verst.monitor.checkpoint_dirs import CheckpointError, base_config_file

        try:
            recipe = str(base_config_file(run_dir))
        except CheckpointError as error:
            raise ConfigError(str(error)) from None
    return recipe, [*rest, "--checkpoint.load", run_dir]


def print_dry_run(cfg: VerstConfig) -> None:
    import yaml

    print("# resolved config")
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    if not cfg.lora.adapters:
        print("# batch arithmetic")
        print(batch_plan(cfg).describe())
        return
    from verst.config.adapters import adapter_run_config

    for adapter in cfg.lora.adapters:  # multi-LoRA: each adapter's own batch plan
        print(f"# batch arithmetic of adapter {adapter.name!r}")
        print(batch_plan(adapter_run_config(cfg, adapter.name)).describe())
