"""`verst train RECIPE`: RL training with the schedule the config names."""

from __future__ import annotations

import asyncio
import sys

from verst.cli.config_command import run_config_command
from verst.config import VerstConfig

DESCRIPTION = "RL post-training (GRPO and friends) with the sync, one_step_off or fully_async schedule."


def main(argv: list[str]) -> int:
    return run_config_command("train", argv, DESCRIPTION, _run, rl=True)


def _run(cfg: VerstConfig) -> None:
    from verst.orchestration.watchdog import RunFailure
    from verst.schedules import SCHEDULES

    try:
        asyncio.run(SCHEDULES[cfg.schedule](cfg))
    except RunFailure as failure:  # its message is the whole story (what failed, what to do): no traceback
        print(f"verst train: {failure}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
