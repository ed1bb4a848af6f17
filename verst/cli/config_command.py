"""Shared argument handling of the config-driven commands (`verst sft`, `verst train`).

`verst CMD [RECIPE] [--dry-run] [--section.field VALUE ...]`; `--help` lists every config field with
its type, default and doc line. The config's files are checked before anything starts (`preflight`).
Nothing here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from verst.config import ConfigError, VerstConfig, batch_plan, iter_fields, load_config


def help_text(prog: str, description: str) -> str:
    lines = [
        f"usage: verst {prog} [RECIPE.toml|.yaml] [--dry-run] [--section.field VALUE ...]",
        "",
        description,
        "",
        "options:",
        "  -h, --help     show this help and exit",
        "  --dry-run      print the resolved config and batch arithmetic, check its files, then exit (no torch import)",
        "  --overwrite    empty an existing run directory first (the config field `overwrite`); without it a",
        "                 run directory that holds files is refused",
        "",
        "config fields (--section.field VALUE; dashes and underscores are interchangeable):",
    ]
    for dotted, type_name, default, doc in iter_fields():
        lines.append(f"  --{dotted.replace('_', '-')} {type_name}  (default: {default!r})")
        lines.append(f"      {doc}")
    return "\n".join(lines)


def run_config_command(prog: str, argv: list[str], description: str, run: Callable[[VerstConfig], object],
                       *, rl: bool) -> int:
    """Parse, check the config's files (exit 2 naming each problem), then `run(cfg)` or, with
    `--dry-run`, print the resolved config and batch arithmetic."""
    from verst.cli.preflight import PreflightError, preflight

    cfg, dry_run = parse_config_command(prog, argv, description)
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
        run(cfg)
    return 0


def parse_config_command(prog: str, argv: list[str], description: str) -> tuple[VerstConfig | None, bool]:
    """Return (config, dry_run); (None, False) after printing help. Exits 2 on a bad config."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(prog, description))
        return None, False
    args = list(argv)
    dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    recipe = args.pop(0) if args and not args[0].startswith("--") else None
    try:
        cfg = load_config(recipe, args)
    except ConfigError as e:
        print(f"verst {prog}: {e}", file=sys.stderr)
        sys.exit(2)
    return cfg, dry_run


def print_dry_run(cfg: VerstConfig) -> None:
    import yaml

    print("# resolved config")
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    print("# batch arithmetic")
    print(batch_plan(cfg).describe())
