"""Next-token sampling for a batch of rows with per-row settings, and the logprob of each sampled token.

Reported logprobs are `log_softmax(logits / T)` of the sampled token: the same scaled logits the sampler
draws from, before top-k/top-p/min-p truncation (SGLang's default). Greedy rows (T = 0) use T = 1, so at
T = 1 and for greedy decoding they equal the model's raw log-probabilities.
"""

from __future__ import annotations

import dataclasses

import torch

from verst.inference_client.protocol import SamplingParams

_SEED_MIX = 1_000_003  # seed and position combine into one generator seed: same (seed, position), same draw


@dataclasses.dataclass(slots=True)
class RowSampling:
    """One row's step: its request's sampling params (temperature, top-p/k, min-p and seed are read
    there), `position`, the index of the token being sampled within the output, and this step's extras."""

    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    position: int = 0
    banned: tuple[int, ...] = ()  # ids masked out (stop tokens before min_new_tokens)
    top_logprobs: int = 0


@dataclasses.dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]]]  # per row, empty where not asked for


def sample(logits: torch.Tensor, rows: list[RowSampling], generator: torch.Generator) -> SampleOutput:
    """Sample one token per row of `logits` [batch, vocab]."""
    logits = logits.float()
    batch, vocab = logits.shape
    if len(rows) != batch:
        raise ValueError(f"sample: {batch} logit rows but {len(rows)} sampling settings")
    for i, row in enumerate(rows):
        if row.banned:
            logits[i, list(row.banned)] = float("-inf")
    temps = torch.tensor([row.params.temperature for row in rows], dtype=torch.float32)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]  # [batch, vocab]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        drawn = _draw(_truncate(scaled, rows), rows, generator)
        tokens = torch.where(greedy, tokens, drawn)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top: list[list[tuple[float, int]]] = []
    for i, row in enumerate(rows):
        if row.top_logprobs:
            values, ids = logprobs[i].topk(min(row.top_logprobs, vocab))
            top.append(list(zip(values.tolist(), ids.tolist())))
        else:
            top.append([])
    return SampleOutput(tokens=tokens.tolist(), logprobs=chosen.tolist(), top=top)


def _truncate(scaled: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Apply top-k, top-p and min-p per row; removed tokens get -inf."""
    batch, vocab = scaled.shape
    need_k = any(0 < row.params.top_k < vocab for row in rows)
    need_p = any(row.params.top_p < 1.0 for row in rows)
    need_min_p = any(row.params.min_p > 0.0 for row in rows)
    if not (need_k or need_p or need_min_p):
        return scaled
    out = scaled.clone()
    if need_k:
        ks = torch.tensor([row.params.top_k if 0 < row.params.top_k < vocab else vocab for row in rows])
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])  # [batch, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if need_p:
        top_p = torch.tensor([row.params.top_p for row in rows])[:, None]
        probs, order = torch.softmax(out, dim=-1).sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p; the first token always stays
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    if need_min_p:
        min_p = torch.tensor([row.params.min_p for row in rows])[:, None]
        probs = torch.softmax(out, dim=-1)
        out = out.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return out


def _draw(scaled: torch.Tensor, rows: list[RowSampling], generator: torch.Generator) -> torch.Tensor:
    """Categorical draws by the exponential race: argmax(p / E), E ~ Exp(1), one noise row per sample.

    Seeded rows draw their noise from a generator keyed by (seed, position), so a seeded request gives
    the same tokens whatever else shares its batch, and again after being retracted and recomputed.
    """
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    unseeded = [i for i, row in enumerate(rows) if row.params.sampling_seed is None]
    if unseeded:
        block = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=generator)
        noise[unseeded] = block
    for i, row in enumerate(rows):
        if row.params.sampling_seed is not None:
            g = torch.Generator().manual_seed((row.params.sampling_seed * _SEED_MIX + row.position) % (2**63))
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)
