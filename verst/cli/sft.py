"""`verst sft RECIPE`: supervised fine-tuning on chat data, evaluation and export."""

from __future__ import annotations

from verst.cli.config_command import parse_config_command, print_dry_run

DESCRIPTION = "Supervised fine-tuning (loss on assistant tokens only), held-out evaluation, HF export."


def main(argv: list[str]) -> int:
    cfg, dry_run = parse_config_command("sft", argv, DESCRIPTION)
    if cfg is None:
        return 0
    if dry_run:
        print_dry_run(cfg)
        return 0
    from verst.schedules.sft import run_sft

    run_sft(cfg)
    return 0
