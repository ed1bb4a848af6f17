"""How a request ends, as SGLang decides it: the length limit, stop and EOS tokens, stop strings, the context;
the sampling settings of its next token (EOS banned below `min_new_tokens`); its final text; and the model
facts these read (its EOS ids). Pure functions over a request; the engine core calls them.
"""

from __future__ import annotations

from typing import Any

import torch

from verst.engine.lora import LoraAdapter
from verst.engine.request import FinishReason, Request
from verst.engine.sampling import RowSampling


def finish_reason(req: Request, eos_ids: set[int], context_length: int, tokenizer: Any) -> FinishReason | None:
    """Why `req` ends after its last token, or None: SGLang's order (the length limit, then stop/eos tokens,
    then stop strings, then the context)."""
    s, token, n = req.sampling, req.output_ids[-1], len(req.output_ids)
    if s.max_new_tokens is not None and n >= s.max_new_tokens:
        return FinishReason("length", length=n)
    if token in s.stop_token_ids or (not s.ignore_eos and token in eos_ids):
        return FinishReason("stop", matched=token)
    if s.stop and (matched := matched_stop_string(req, tokenizer)) is not None:
        return FinishReason("stop", matched=matched)
    if req.num_tokens >= context_length:
        return FinishReason("length", length=n)
    return None


def matched_stop_string(req: Request, tokenizer: Any) -> str | None:
    longest = max(len(s) for s in req.sampling.stop)
    # a token decodes to at least a fraction of a character (byte-level: 1/4), so this tail is enough
    tail = tokenizer.decode(req.output_ids[-(4 * longest + 8) :], skip_special_tokens=False)
    return next((s for s in req.sampling.stop if s in tail), None)


def row_sampling(req: Request, eos_ids: set[int]) -> RowSampling:
    """The settings `sample` draws `req`'s next token with; below `min_new_tokens` no stop or EOS token."""
    s = req.sampling
    banned: tuple[int, ...] = ()
    if len(req.output_ids) < s.min_new_tokens:
        banned = tuple(s.stop_token_ids) + (() if s.ignore_eos else tuple(eos_ids))
    return RowSampling(s, len(req.output_ids), banned, req.top_logprobs_num)


def final_text(req: Request, tokenizer: Any) -> str:
    """The finished request's text, cut at a matched stop string unless `no_stop_trim`."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(req.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
    if isinstance(req.finish.matched, str) and not req.sampling.no_stop_trim:
        cut = [i for i in (text.find(s) for s in req.sampling.stop) if i >= 0]
        if cut:
            text = text[: min(cut)]
    return text


def namespace(req: Request) -> str | None:
    """The prefix-cache namespace of a request's KV: its adapter's name and version, or None (the base)."""
    return None if req.lora is None else req.lora.cache_key


def row_adapters(reqs: list[Request]) -> list[LoraAdapter | None] | None:
    """Each row's adapter, or None when no row names one (the plain base forward)."""
    adapters = [r.lora for r in reqs]
    return adapters if any(a is not None for a in adapters) else None


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS ids from the generation config, the model config and the tokenizer, as SGLang collects them."""
    ids: set[int] = set()
    sources = [getattr(getattr(model, "generation_config", None), "eos_token_id", None),
               getattr(model.config, "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None]
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def check_true_on_policy(model: Any) -> None:
    """True on-policy needs the trainer's own forward in float32 on the CPU: the native model class."""
    from verst.models.native import NativeCausalLM

    param = next(model.parameters())
    if not isinstance(model, NativeCausalLM) or param.dtype != torch.float32 or param.device.type != "cpu":
        raise ValueError(
            f"EngineConfig.true_on_policy needs the native model class in float32 on the CPU (the trainer's "
            f"forward); got {type(model).__name__} in {param.dtype} on {param.device.type}")
