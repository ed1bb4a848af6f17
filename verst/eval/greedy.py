"""Held-out evaluation: greedy responses to test prompts, scored by the run's reward fn.

Generation is a callable (`GenerateFn`), so the same scoring runs over Hugging Face `generate`
(SFT, no engine) or over the rollout engines (the RL loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from verst.config import DataConfig
from verst.models.prompts import encode_prompt
from verst.rewards import compute_rewards
from verst.types import Sample, Status

# prompt ids of a batch -> response ids of each (ending at, and including, eos when it was emitted)
GenerateFn = Callable[[list[list[int]]], list[list[int]]]


def hf_greedy_generate(model: Any, tokenizer: Any, max_new_tokens: int, batch_size: int) -> GenerateFn:
    """A GenerateFn over `model.generate` with left padding, greedy, stopping at eos."""
    import torch

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        out: list[list[int]] = []
        model.eval()
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # left padding: the last prompt token is aligned
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            with torch.no_grad():
                gen = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                )
            for row in gen[:, width:].tolist():
                out.append(_until_eos(row, tokenizer.eos_token_id))
        return out

    return generate


def evaluate_greedy(
    prompts: Sequence[Sample],
    generate: GenerateFn,
    tokenizer: Any,
    reward: Any,
    data: DataConfig,
    max_new_tokens: int,
) -> dict[str, float]:
    """Score greedy responses; `eval/accuracy` is the mean reward (1/0 rewards: the solved fraction).

    `reward` is a RewardConfig (a remote client is then built and closed here) or a reward fn.
    """
    start = time.perf_counter()
    samples = [_prompt_sample(s, tokenizer, data) for s in prompts]
    responses = generate([s.tokens for s in samples])
    for s, resp in zip(samples, responses):
        s.tokens = s.tokens + resp
        s.response_length = len(resp)
        s.loss_mask, s.rollout_logprobs = [1] * len(resp), [0.0] * len(resp)
        s.response = tokenizer.decode(resp, skip_special_tokens=True)
        ended = bool(resp) and resp[-1] == tokenizer.eos_token_id
        s.status = Status.COMPLETED if ended else Status.TRUNCATED
    asyncio.run(compute_rewards(samples, reward))
    scored = [s for s in samples if s.status != Status.FAILED]
    if not scored:
        raise RuntimeError(f"evaluation: all {len(samples)} samples failed to score; first reason: "
                           f"{samples[0].metadata.get('reward_error')!r}")
    return {
        "eval/accuracy": sum(s.reward_value() for s in scored) / len(scored),
        "eval/response_length": sum(s.response_length for s in samples) / len(samples),
        "eval/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "eval/reward_failures": float(len(samples) - len(scored)),
        "eval/n_prompts": float(len(samples)),
        "time/eval_s": time.perf_counter() - start,
    }


def _prompt_sample(prompt: Sample, tokenizer: Any, data: DataConfig) -> Sample:
    ids = encode_prompt(
        tokenizer, prompt.prompt, apply_chat_template=data.apply_chat_template,
        system_prompt=data.system_prompt, tools=prompt.metadata.get("tools"),
    )
    return Sample(tokens=ids, prompt=prompt.prompt, label=prompt.label, metadata=dict(prompt.metadata),
                  index=prompt.index, group_index=prompt.group_index)


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row
