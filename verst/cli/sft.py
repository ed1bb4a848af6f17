"""`verst sft RECIPE`: supervised fine-tuning on chat data, evaluation and export."""

from __future__ import annotations

from verst.cli.config_command import run_config_command
from verst.config import VerstConfig

DESCRIPTION = "Supervised fine-tuning (loss on assistant tokens only), held-out evaluation, HF export."


def main(argv: list[str]) -> int:
    return run_config_command("sft", argv, DESCRIPTION, _run, rl=False)


def _run(cfg: VerstConfig) -> None:
    from verst.schedules.sft import run_sft

    run_sft(cfg)
