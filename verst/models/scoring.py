"""The logprobs of given tokens under a causal LM, as the trainer computes them: one function for the
trainer's micro-batches and for the engine's true on-policy scoring pass, so both run the same ops.

`token_logprobs` is the arithmetic after the forward (float32 logits, temperature, log-softmax, gather);
`sequence_logprobs` runs one whole sequence alone (batch of one, no padding) through the model's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(target) from `logits` [n, vocab] (any dtype) and `targets` [n]: float32 logits divided by
    `temperature` (skipped at 1, a no-op that would still round), log-softmax over the vocabulary.
    Returns (the targets' logprobs [n], the whole log-softmax [n, vocab])."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)  # [n, vocab]
    return log_probs.gather(-1, targets[:, None])[:, 0], log_probs


def sequence_inputs(tokens: list[int] | torch.Tensor, response_length: int) -> dict[str, torch.Tensor]:
    """The forward's inputs for one sequence alone, [1, len] each: ids, positions 0..len-1, and the
    positions whose logits predict a response token (prompt_length - 1 .. len - 2)."""
    ids = torch.as_tensor(tokens, dtype=torch.long)[None]  # [1, len]
    length = ids.shape[1]
    keep = torch.zeros(1, length, dtype=torch.bool)
    keep[0, length - 1 - response_length : length - 1] = True
    return {"input_ids": ids, "position_ids": torch.arange(length)[None], "logits_to_keep": keep}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's CPU ops on one intra-op thread, as each trainer rank does: a kernel's reduction order
    may follow how its work is split between threads."""
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


@torch.no_grad()
def sequence_logprobs(model: Any, tokens: list[int], response_length: int, temperature: float) -> list[float]:
    """log π of the last `response_length` tokens of `tokens`, from one forward of the whole sequence alone
    on one thread (the trainer's per-sequence micro-batch of `algorithm.true_on_policy`)."""
    if response_length == 0:
        return []
    inputs = sequence_inputs(tokens, response_length)
    device = next(model.parameters()).device
    with one_thread():
        logits = model(**{k: v.to(device) for k, v in inputs.items()}, use_cache=False).logits  # [resp, vocab]
        targets = inputs["input_ids"][0, -response_length:].to(device)
        chosen, _ = token_logprobs(logits, targets, temperature)
    return chosen.cpu().tolist()
