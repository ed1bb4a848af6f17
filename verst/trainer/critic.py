"""PPO's critic on the trainer ranks: the policy's architecture with its LM head replaced by a scalar value
head, sharded next to the policy with its own AdamW; its forward gives per-token values of the response.
"""

from __future__ import annotations

import dataclasses

import torch

from verst.config.schema import CriticConfig, TrainerConfig
from verst.trainer.batching import ForwardOutputs, MicroBatch, kept_outputs
from verst.trainer.optim import build_optimizer


@dataclasses.dataclass
class Critic:
    """The value model with its optimizer and lr schedule; `grad_clip` bounds its global grad norm."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float


def add_value_head(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a causal LM, native or transformers') with its LM head replaced by Linear(hidden, 1).

    The head is zero-initialised: every value starts at exactly 0, so the first GAE advantages are the
    discounted rewards themselves, and the head is never tied to the embedding (the trunk keeps its own).
    Its output at the position that predicts response token t is V(s_t), the value of the state before t.
    """
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no lm_head to replace with a value head")
    head = torch.nn.Linear(model.config.get_text_config().hidden_size, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model


def check_same_vocabulary(value_model: torch.nn.Module, policy: torch.nn.Module, path: str) -> None:
    """The critic reads the policy's token ids: a checkpoint with another vocabulary is refused by name."""
    sizes = [m.config.get_text_config().vocab_size for m in (value_model, policy)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"critic.model_path = {path!r} has a vocabulary of {sizes[0]} tokens, the policy {sizes[1]}; "
                         "the value model must read the policy's token ids (use a checkpoint of the same tokenizer)")


def critic_optimizer(model: torch.nn.Module, trainer: TrainerConfig, critic: CriticConfig,
                     total_steps: int | None) -> Critic:
    """AdamW and lr schedule of the value model: the trainer's settings with the critic's lr, warm-up and
    grad clip (one critic step per policy step, so the same `total_steps`)."""
    settings = trainer.model_copy(update={"lr": critic.lr, "warmup_steps": critic.warmup_steps,
                                          "grad_clip": critic.grad_clip})
    optimizer, scheduler = build_optimizer(model, settings, total_steps)
    return Critic(model, optimizer, scheduler, critic.grad_clip)


def value_forward(model: torch.nn.Module, batch: MicroBatch) -> ForwardOutputs:
    """The value model's forward over one micro-batch -> `ForwardOutputs.values` [n_seq, max_resp]."""
    values = kept_outputs(model, batch).float().reshape(-1)  # [n_resp_tokens]: the head's one output per kept position
    if values.numel() != batch.targets.numel():
        raise RuntimeError(f"the value head gave {values.numel()} values for {batch.targets.numel()} response tokens")
    return ForwardOutputs(values=batch.pad_responses(values))
