"""One generation request inside the engine: its tokens, sampling params, progress and finish reason.

Also the SGLang-shaped reply built from a finished (or streaming) request.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from verst.inference_client.protocol import InvalidRequest, SamplingParams


class Phase(str, enum.Enum):
    WAITING = "waiting"  # queued, no KV
    RUNNING = "running"  # owns a KV slot
    FINISHED = "finished"


@dataclasses.dataclass
class FinishReason:
    """SGLang's `meta_info.finish_reason`: type stop (with `matched`), length, or abort (with `message`)."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        elif self.type == "abort":
            out["message"] = self.message
        return out


@dataclasses.dataclass(eq=False)
class Request:
    """A request's whole life in the engine. Lists only grow, so readers in another thread may slice them.

    The KV of `tokens()[:kv_len]` lives in slot `slot` while running; the last sampled token has no KV
    until it is fed back. `routed_experts` rows align with those KV tokens: `[kv_len, moe_layers, top_k]`.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # >= 0: the prompt's logprobs from this position (SGLang's input_token_logprobs)
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    priority: int = 0  # admission order among waiting requests: higher first, then arrival
    lora_path: str | None = None  # the name of the LoRA adapter to generate with (SGLang's field); None: base
    lora: Any = None  # that adapter (`verst.engine.lora.LoraAdapter`), resolved when the engine takes the request
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    # prompt positions logprob_start_len.. : log p(token | the tokens before it); None at position 0
    input_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    routed_experts: list[np.ndarray] = dataclasses.field(default_factory=list)
    phase: Phase = Phase.WAITING
    slot: int | None = None
    kv_len: int = 0
    cached_tokens: int = -1  # -1 until first admitted
    finish: FinishReason | None = None
    text: str | None = None  # final text (stop-string trimmed), set when finished
    weight_version: str = ""
    # The version that sampled the first output token: a weight update while the request was paused
    # in place or retracted leaves older tokens in its output, so this is the oldest version in it.
    oldest_weight_version: str | None = None
    created: float = dataclasses.field(default_factory=time.monotonic)
    finished_at: float | None = None
    on_token: Callable[[Request], None] | None = None  # called after every appended token (streaming)
    on_finish: Callable[[Request], None] | None = None

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def experts_array(self) -> np.ndarray | None:
        if not self.routed_experts:
            return None
        return np.concatenate(self.routed_experts, axis=0)


def generate_reply(req: Request, text: str, n_tokens: int | None = None, return_text: Callable | None = None) -> dict:
    """The SGLang `/generate` reply for `req`, covering its first `n_tokens` output tokens (all by default).

    `output_token_logprobs` holds `[logprob, token_id, text_or_null]` triples; `routed_experts` is the
    base64 of an int32 array `[prompt + output - 1, moe_layers, top_k]`, as SGLang sends it.
    """
    n = len(req.output_ids) if n_tokens is None else n_tokens
    output_ids = req.output_ids[:n]
    done = req.finished and n == len(req.output_ids)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish.to_json() if done and req.finish else None,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": n,
        "cached_tokens": max(req.cached_tokens, 0),
        "weight_version": req.weight_version,
        "oldest_weight_version": req.oldest_weight_version or req.weight_version,
        "e2e_latency": (req.finished_at or time.monotonic()) - req.created,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, return_text(tok) if return_text else None] for lp, tok in zip(req.output_logprobs[:n], output_ids)
        ]
        if req.logprob_start_len >= 0:
            ids = req.prompt_ids[req.logprob_start_len :]
            meta["input_token_logprobs"] = [
                [lp, tok, return_text(tok) if return_text else None] for lp, tok in zip(req.input_logprobs, ids)
            ]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [[lp, tok, return_text(tok) if return_text else None] for lp, tok in top]
                for top in req.output_top_logprobs[:n]
            ]
    if req.return_routed_experts and done:
        experts = req.experts_array()
        meta["routed_experts"] = (
            base64.b64encode(np.ascontiguousarray(experts, dtype=np.int32).tobytes()).decode("ascii")
            if experts is not None
            else None
        )
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def check_request(req: Request, vocab_size: int, context_length: int, *, has_tokenizer: bool) -> None:
    """Refuse a request an engine of this vocabulary and context length cannot serve, naming the field and
    value: an empty prompt, a token id outside the vocabulary, a prompt as long as the context, stop token ids
    outside the vocabulary, stop strings without a tokenizer to find them with."""
    if not req.prompt_ids:
        raise InvalidRequest("input_ids", req.prompt_ids, "the prompt is empty")
    ids = req.prompt_ids
    if min(ids) < 0 or max(ids) >= vocab_size:  # builtins: a tenth of a generator's cost per request
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequest("input_ids", bad, f"token id outside the vocabulary [0, {vocab_size})")
    if len(req.prompt_ids) >= context_length:
        raise InvalidRequest("input_ids", f"{len(req.prompt_ids)} tokens",
                             f"the prompt must be shorter than the context length ({context_length} tokens)")
    bad = next((t for t in req.sampling.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest("sampling_params.stop_token_ids", bad, f"outside the vocabulary [0, {vocab_size})")
    if req.sampling.stop and not has_tokenizer:
        raise InvalidRequest("sampling_params.stop", req.sampling.stop, "stop strings need a tokenizer")
