"""`verst sft RECIPE`: supervised fine-tuning on chat data, evaluation and export."""

from __future__ import annotations

from verst.cli.config_command import run_config_command
from verst.config import VerstConfig

DESCRIPTION = "Supervised fine-tuning (loss on assistant tokens only), held-out evaluation, HF export."
# What SFT reads, field by field or a whole section: `--help` lists these. RL's loop (rollouts, losses, buffer,
# weight sync, engines, teacher, fault limits) is not run; its evaluation generates with the trainer's model.
SFT_FIELDS = (
    "plugins", "name", "run_dir", "overwrite", "model", "data", "reward", "sft", "checkpoint",
    *(f"trainer.{name}" for name in ("backend", "lr", "min_lr_ratio", "lr_schedule", "warmup_steps", "weight_decay",
                                     "adam_betas", "grad_clip", "max_tokens_per_micro_batch",
                                     "gradient_checkpointing", "seed")),
    *(f"lora.{name}" for name in ("enabled", "rank", "alpha", "dropout", "target_modules")),
    # the evaluation: its prompts and lengths, and an agent's episodes for a tool-using task
    *(f"eval.{name}" for name in ("max_prompts", "max_response_tokens", "batch_size")),
    *(f"rollout.{name}" for name in ("max_response_tokens", "max_prompt_tokens", "max_context_tokens", "agent_fn",
                                     "generate_fn")),
    *(f"cluster.{name}" for name in ("trainer_ranks", "device", "ray_address", "trainer_resources")),
    *(f"logging.{name}" for name in ("tensorboard", "wandb", "wandb_project", "progress")),
)


def main(argv: list[str]) -> int:
    return run_config_command("sft", argv, DESCRIPTION, _run, rl=False, fields=SFT_FIELDS)


def _run(cfg: VerstConfig) -> None:
    from verst.schedules.sft import run_sft

    run_sft(cfg)
