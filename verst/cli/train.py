"""`verst train RECIPE`: RL training with the schedule the config names."""

from __future__ import annotations

import asyncio

from verst.cli.config_command import parse_config_command, print_dry_run

DESCRIPTION = "RL post-training (GRPO and friends) with the sync, one_step_off or fully_async schedule."


def main(argv: list[str]) -> int:
    cfg, dry_run = parse_config_command("train", argv, DESCRIPTION)
    if cfg is None:
        return 0
    if dry_run:
        print_dry_run(cfg)
        return 0
    from verst.schedules import SCHEDULES

    asyncio.run(SCHEDULES[cfg.schedule](cfg))
    return 0
